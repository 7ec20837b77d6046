"""The contracts every part of torchyard shares, torch-free (pydantic and the standard
library only): the API, the scheduler, the worker, the trainer and the client read them
without loading torch, and none of them owns them.

    spec.py        the v1 job spec (pydantic models), `parse_spec`, `spec_to_dict`
    specerrors.py  how a spec's problems are worded (`SpecError`, did-you-mean)
    datasets.py    the data-set catalogue (files on disk) and the size estimates for limits
    eventmodel.py  the trainer → worker event format, one model per event type
    eventfiles.py  the event files' names
    exitcodes.py   the trainer's exit codes
    states.py      job, attempt and worker states as enums, with their transition tables
    parent.py      die with the parent (PR_SET_PDEATHSIG), for every child we start
    plurals.py     counts in words (`plural(1, "worker")`: "1 worker"), for every part
"""
