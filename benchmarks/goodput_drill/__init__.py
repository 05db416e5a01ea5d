"""The goodput drill (benchmarks/goodput.py): one seeded schedule of faults, run under
trainwatch, torchrun and NVIDIA's ft_launcher in turn, and how much of the wall time
each turned into training that counts."""
