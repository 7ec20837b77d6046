"""The job spec under its first name, `torchyard.trainer.spec`, for code written before the
spec moved to the contracts package: the models and `parse_spec` are
`torchyard.contracts.spec`'s, the data-set catalogue and size estimates
`torchyard.contracts.datasets`'. New code imports those modules."""

from torchyard.contracts.datasets import *  # noqa: F403
from torchyard.contracts.spec import *  # noqa: F403
