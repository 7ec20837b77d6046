"""The seed article's MNIST loop (a 784-128-10 MLP, SGD with momentum, batch 128, the
running loss printed every 200 batches) as a torchyard script job.

Changed from the article only where it talks to torchyard (`torchyard.job`): `setup()` for
the rank and device, `restore()` at the start, `log()` next to the loss print,
`should_stop()` after every batch, `save()` after every epoch and `save_weights()` at the
end; a DistributedSampler (and DDP) when the job has more than one rank. A stop request
mid-epoch returns at once: the job resumes from the last end-of-epoch save.

MNIST is read from the data root (TORCHYARD_DATA_ROOT, which the workers set; default
./data) in torchvision's layout, never downloaded. Without it, scikit-learn's bundled 8x8
digits stand in, upscaled to 28x28 so the model is the same.

    python train.py --epochs 3
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
import torchvision
import torchvision.transforms as transforms
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from torchyard import job

MEAN, STD = 0.1307, 0.3081


def load_data(root: str, say: bool) -> tuple[Dataset, Dataset, int]:
    """(train set, test set, DataLoader workers): MNIST, else the digits stand-in (`say`:
    print that it is, on rank 0 only)."""
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    try:
        trainset = torchvision.datasets.MNIST(root, train=True, download=False, transform=transform)
        testset = torchvision.datasets.MNIST(root, train=False, download=False, transform=transform)
        return trainset, testset, 2
    except RuntimeError:  # "Dataset not found": nothing is downloaded on a worker
        if say:
            print(
                f"MNIST not found under {root}: using scikit-learn's 8x8 digits, upscaled to 28x28"
            )
        return digits()


def digits() -> tuple[Dataset, Dataset, int]:
    """scikit-learn's 1797 8x8 digits as 28x28 MNIST-like tensors, 80/20 train/test."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    x = (x - MEAN) / STD
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = perm[: len(y) // 5], perm[len(y) // 5 :]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]), 0


def main() -> None:
    parser = argparse.ArgumentParser(description="MNIST MLP as a torchyard script job")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    ctx = job.setup()
    trainset, testset, workers = load_data(
        os.environ.get("TORCHYARD_DATA_ROOT", "./data"), ctx.is_main
    )
    sampler = DistributedSampler(trainset) if ctx.world_size > 1 else None
    trainloader = DataLoader(trainset, batch_size=128 // ctx.world_size, shuffle=sampler is None,
                             sampler=sampler, num_workers=workers)  # fmt: skip
    testloader = DataLoader(testset, batch_size=128, shuffle=False, num_workers=workers)

    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    net = net.to(ctx.device)
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    start_epoch = 0
    state = job.restore()
    if state is not None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        if ctx.is_main:
            print(f"resuming after epoch {start_epoch}")
    model = DistributedDataParallel(net) if ctx.world_size > 1 else net
    job.set_total(args.epochs * len(trainloader))  # the run's length: progress and an ETA
    every = min(200, len(trainloader))  # the digits stand-in has fewer batches than that
    step = start_epoch * len(trainloader)

    for epoch in range(start_epoch, args.epochs):  # loop over the dataset multiple times
        if sampler is not None:
            sampler.set_epoch(epoch)
        running_loss = 0.0
        for i, (inputs, labels) in enumerate(trainloader, 0):
            inputs, labels = inputs.to(ctx.device), labels.to(ctx.device)

            # zero the parameter gradients
            optimizer.zero_grad()

            # forward + backward + optimize
            outputs = model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            step += 1

            # print statistics
            running_loss += loss.item()
            if i % every == every - 1:
                if ctx.is_main:
                    print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / every:.3f}")
                job.log(step, **{"train/loss": running_loss / every})
                running_loss = 0.0
            if job.should_stop():  # cancelled or preempted: resume from the last epoch's save
                return
        job.save(
            {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1},
            step,
        )

    if ctx.is_main:
        print("Finished Training")
    correct, total = 0, 0
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(ctx.device))
            correct += (outputs.argmax(1) == labels.to(ctx.device)).sum().item()
            total += labels.size(0)
    if ctx.is_main:
        print(f"Accuracy of the network on the {total} test images: {100 * correct // total} %")
    job.log(step, **{"test/accuracy": correct / total})
    job.save_weights(net.state_dict())


if __name__ == "__main__":
    main()
