"""torchyard's training engine: spec → data, model, AMP, DDP, checkpoints, events.

Run it with `python -m torchyard.trainer` or `torchrun -m torchyard.trainer` (see trainer/cli.py). This
package file imports nothing, so `trainer.spec` and `trainer.exitcodes` load without torch.

    spec.py         the v1 job spec (pydantic only) and missing_dataset_files()
    exitcodes.py    the process's exit codes (no imports)
    cli.py          command line, signals, parent-death, logging the environment and spec
    loop.py         the training loop: a Trainer (build_data, build_net, train_step)
    data.py         data sets as uint8 tensors; device-resident and DataLoader batches
    models.py       mlp, lenet, resnet18 (small-image stem)
    optim.py        optimizers; lr as a pure function of the step
    checkpoint.py   atomic resume checkpoints, RNG states, safetensors weights
    distributed.py  device, process group, the few collectives, precision
    events.py       JSON-lines event sink (and null / in-memory ones)
    eventmodel.py   the event format as pydantic models (torch-free; the worker reads with it)
    eventfiles.py   the event files' names (no imports)
    parent.py       die with the parent: PR_SET_PDEATHSIG (stdlib only)
    signals.py      the stop flag signal handlers set
    envinfo.py      versions and environment for the log and the `started` event
"""
