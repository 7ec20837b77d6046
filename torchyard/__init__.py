"""torchyard: the `torchyard` command (one entry point that dispatches to the service and
the client) and `torchyard.load_model` (a trained job's weights back as an `nn.Module`)."""


def __getattr__(name: str) -> object:
    # `torchyard.load_model` without importing torch for every `import torchyard.…`.
    if name == "load_model":
        from torchyard.model import load_model

        return load_model
    raise AttributeError(f"module 'torchyard' has no attribute {name!r}")
