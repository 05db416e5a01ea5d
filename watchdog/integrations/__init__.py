"""Training-side integrations: plain PyTorch (``trainwatch.integrations.torch``),
Hugging Face ``transformers`` (``.hf``) and PyTorch Lightning (``.lightning``);
``.resume``, where a launched rank resumes (the client's resume_from(), skip_steps()).

Importing this package imports no framework; each module imports its own
framework when it is imported, so ``import trainwatch`` never pulls in torch.

Step numbers are the job's optimizer steps, 1-based: step N is the update that
takes the model from N-1 to N updates (HF ``state.global_step`` and Lightning
``trainer.global_step`` right after it). A checkpoint reported at step N holds
the state after N updates; resuming from it trains step N+1 next.

The skip window (``TRAINWATCH_SKIP_STEPS=start:end``, set by a rollback) is
inclusive at both ends. Every step in it is passed through without training:
its data is drawn and dropped (no forward, no backward, no optimizer update)
and it is beaten with no values, so step numbers, the learning-rate schedule by
step and the data of every later step stay those of an uninterrupted run (as
Megatron-LM's skipped iterations do). That skips the very data of those steps
only when the batch of step k is a function of k; each integration says whether
its loader makes it so (``client.Heartbeat.data_order``), and the rollback
records the skip as exact or approximate (actions/rollback.py).
"""
