"""The models a spec can name: built in (`mlp`, `lenet`, `resnet18`), any torchvision
classification model (`torchvision/<name>`, random init) or the user's factory
(`module:function`). Input shape and class count come from the data; the server's size
limit is checked before a model the API could not count is allocated (modelguard.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from torchyard.contracts.spec import ModelSpec
from torchyard.trainer.failures import SpecProblem, UserCodeError
from torchyard.trainer.modelguard import checked_build
from torchyard.trainer.usercode import call_user, load_factory


def mlp(in_features: int, hidden: list[int], num_classes: int) -> nn.Module:
    """Flatten, then Linear+ReLU per hidden width (the seed article's 784-128-10 by default)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class LeNet(nn.Module):
    """The classic CNN of the seed article (conv 6-16 with 5x5 kernels, fc 120-84). Images
    smaller than 16 pixels a side (digits' 8x8) get padding 2 so both poolings fit."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        c, h, w = in_shape
        pad = 0 if min(h, w) >= 16 else 2
        self.features = nn.Sequential(
            nn.Conv2d(c, 6, 5, padding=pad),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, padding=pad),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.features(torch.zeros(1, c, h, w)).shape[1]
        self.classifier = nn.Sequential(
            nn.Linear(flat, 120),
            nn.ReLU(inplace=True),
            nn.Linear(120, 84),
            nn.ReLU(inplace=True),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class GlobalAvgPool(nn.Module):
    """AdaptiveAvgPool2d(1) as a mean: the same numbers, but its backward is deterministic
    on CUDA (adaptive pooling's is not, and `deterministic: true` would refuse it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3), keepdim=True)


def resnet18(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 (random init, nothing downloaded) with a small-image stem:
    a 3x3 stride-1 first conv and no max-pool, as is usual for 32x32 inputs."""
    from torchvision.models import resnet18 as tv_resnet18

    m = tv_resnet18(weights=None, num_classes=num_classes)
    m.conv1 = nn.Conv2d(in_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    m.avgpool = GlobalAvgPool()
    return m


def torchvision_model(name: str, num_classes: int, args: dict[str, object]) -> nn.Module:
    """`torchvision/<name>`: any classification model torchvision lists, built with
    `weights=None` (nothing is downloaded) and the data's class count."""
    import torchvision.models as tvm

    known = tvm.list_models(module=tvm)
    if name not in known:
        raise SpecProblem(
            f"model.name: torchvision has no classification model {name!r}; it has "
            + ", ".join(known)
        )
    try:
        return tvm.get_model(name, weights=None, num_classes=num_classes, **args)
    except (TypeError, ValueError) as e:  # model.args it does not take
        raise SpecProblem(f"model.args: torchvision/{name}: {e}") from e


def factory_model(
    name: str, in_shape: tuple[int, ...], num_classes: int, args: dict[str, object]
) -> nn.Module:
    """`module:function`: the user's factory, `function(in_shape=, num_classes=, **args)`."""
    fn = load_factory(name)
    net = call_user(
        f"building the model {name}", fn, in_shape=in_shape, num_classes=num_classes, **args
    )
    if not isinstance(net, nn.Module):
        raise UserCodeError(f"model {name} returned {type(net).__name__}, not a torch.nn.Module")
    return net


def build_model(spec: ModelSpec, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The spec's model for samples of `in_shape`; the caller seeds torch first. A
    torchvision or factory model is counted before it is allocated, against the server's
    limit in the environment (modelguard.py); built-in models were counted at submit."""
    args = spec.args or {}
    if spec.kind == "torchvision":
        name = spec.name.partition("/")[2]
        return checked_build(lambda: torchvision_model(name, num_classes, args), spec.name)
    if spec.kind == "factory":
        shape = tuple(in_shape)
        return checked_build(
            lambda: factory_model(spec.name, shape, num_classes, args), f"model {spec.name}"
        )
    if spec.name == "mlp":
        return mlp(math.prod(in_shape), spec.hidden_sizes, num_classes)
    if len(in_shape) != 3:
        raise ValueError(
            f"model '{spec.name}' needs images [C, H, W], the data has {list(in_shape)}"
        )
    if spec.name == "lenet":
        return LeNet(in_shape, num_classes)
    if spec.name == "resnet18":
        return resnet18(in_shape, num_classes)
    raise ValueError(f"unknown model {spec.name!r}")
