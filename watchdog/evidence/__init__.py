"""evidence: what trainwatch keeps of a stalled job just before it kills it.

A ``Capture`` (``capture.py``) runs in a daemon thread, bounded by a deadline
(5 s by default) so recovery is not held up, and never raises into the daemon
loop. Into the incident's folder (``show.folder``:
``<state_dir>/jobs/<job>/incidents/<id>``) it writes:

- ``stacks/rank<N>.json`` and ``.txt``: ``py-spy dump`` of every rank, all
  ranks at once (``pyspy.py``); ``pid<P>.*`` for a process that is no rank;
- ``log-tail.txt`` and ``log-tail.rank<N>.txt``: the last lines of the job's
  output, and of each rank's where lines carry torchrun's prefixes
  (``logtail.py``);
- ``flight-recorder/``: PyTorch's flight-recorder dumps, triggered through its
  dump pipes and copied (``flightrecorder.py``, which also gives the job's
  environment settings);
- ``series.json``: for a loss anomaly (whatever ``evidence.kinds`` says), the
  lead rank's loss and grad norm around the onset, written as the incident is
  recorded (``series.py``);
- ``catalog.json``: the job's checkpoint catalog as it stood when the incident
  was recorded (``actions.evidence.keep_beside``), for the incident page's table;
- ``evidence.json``: the summary: per target its process state, CPU time and
  how py-spy fared; the verdict from the stacks
  (``trainwatch.detectors.stacks``); the seconds spent; the files.

``show.render`` prints it all for ``trainwatch incidents --show N``.
"""
