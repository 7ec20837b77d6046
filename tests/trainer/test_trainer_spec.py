"""The job spec: every bad input is reported with its field, all at once; the CLI refuses a
bad spec with exit 2 and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import REPO, make_spec, trainer_env, write_cifar, write_mnist, write_spec

from torchyard.contracts import exitcodes
from torchyard.contracts.datasets import missing_dataset_files
from torchyard.contracts.spec import JobSpec, SpecError, parse_spec, spec_to_dict
from torchyard.contracts.specerrors import MAX_LISTED, without_excess_unknown


def _with(path: str, value: Any) -> dict[str, Any]:
    """make_spec() with one dotted field set (or deleted, for value=...)."""
    spec = make_spec()
    *parents, leaf = path.split(".")
    node = spec
    for p in parents:
        node = node.setdefault(p, {})
    if value is ...:
        del node[leaf]
    else:
        node[leaf] = value
    return spec


BAD_SPECS: list[tuple[str, dict[str, Any], list[tuple[str, str]]]] = [
    ("unknown top-level field", _with("learning_rate", 0.1), [("learning_rate", "unknown field")]),
    ("a spec never names a path", _with("data.path", "/etc"), [("data.path", "unknown field")]),
    ("model missing", _with("model", ...), [("model", "required (or give 'entrypoint' and 'code')")]),
    ("optimizer missing", _with("optimizer", ...), [("optimizer", "required (or give 'entrypoint' and 'code')")]),
    ("unknown model", _with("model.name", "vgg"), [("model.name", "must be one of 'mlp', 'lenet', 'resnet18', 'torchvision/<name>' or 'module:function'")]),
    ("a torchvision model without its prefix", _with("model.name", "resnet50"),
     [("model.name", "must be one of 'mlp', 'lenet', 'resnet18', 'torchvision/<name>' or "
                    "'module:function'; did you mean 'torchvision/resnet50'?")]),
    ("a built-in's typo", _with("data.name", "mnst"),
     [("data.name", "must be one of 'digits', 'mnist', 'fashion_mnist', 'cifar10', 'synthetic', "
                   "'imagefolder/<dir>' or 'module:function'; did you mean 'mnist'?")]),
    ("unknown data set", _with("data.name", "imagenet"),
     [("data.name", "must be one of 'digits', 'mnist', 'fashion_mnist', 'cifar10', 'synthetic', "
                   "'imagefolder/<dir>' or 'module:function'")]),
    ("lr negative", _with("optimizer.lr", -0.1), [("optimizer.lr", "must be > 0.0")]),
    ("lr too large", _with("optimizer.lr", 100.0), [("optimizer.lr", "must be <= 10.0")]),
    ("lr as a string", _with("optimizer.lr", "0.1"), [("optimizer.lr", 'must be a number, got "0.1" (a string)')]),
    ("lr NaN", _with("optimizer.lr", float("nan")), [("optimizer.lr", "must be a finite number")]),
    ("grad_clip infinite", _with("grad_clip", float("inf")), [("grad_clip", "must be a finite number")]),
    ("batch_size zero", _with("batch_size", 0), [("batch_size", "must be >= 1")]),
    ("batch_size as a float", _with("batch_size", 64.0), [("batch_size", "must be an integer, got 64.0 (a number)")]),
    ("epochs as a string", _with("epochs", "5"), [("epochs", 'must be an integer, got "5" (a string)')]),
    ("batch not divisible by world size", {**make_spec(), "batch_size": 63, "world_size": 2},
     [("batch_size", "must be divisible by world_size (2)")]),
    ("val_fraction 1", _with("data.val_fraction", 1.0), [("data.val_fraction", "must be < 1.0")]),
    ("momentum with adam", _with("optimizer", {"name": "adam", "momentum": 0.9}),
     [("optimizer.momentum", "only applies to 'sgd', not 'adam'")]),
    ("betas with sgd", _with("optimizer.betas", [0.9, 0.99]),
     [("optimizer.betas", "only applies to 'adam' and 'adamw', not 'sgd'")]),
    ("hidden with lenet", _with("model", {"name": "lenet", "hidden": [10]}),
     [("model.hidden", "only applies to model 'mlp', not 'lenet'")]),
    ("hidden width zero", _with("model.hidden", [32, 0]), [("model.hidden.1", "must be > 0")]),
    ("shape with digits", _with("data.shape", [1, 8, 8]),
     [("data.shape", "only applies to data 'synthetic', not 'digits'")]),
    ("lenet on flat synthetic data", {**make_spec(), "model": {"name": "lenet"},
                                      "data": {"name": "synthetic", "shape": [64]}},
     [("data.shape", "model 'lenet' needs [channels, height, width]")]),
    ("precision fp8", _with("precision", "fp8"), [("precision", "must be one of 'auto', 'fp32', 'fp16' or 'bf16', got \"fp8\" (a string)")]),
    ("keep_last zero", _with("checkpoint.keep_last", 0), [("checkpoint.keep_last", "must be >= 1")]),
    ("checkpoint not an object", _with("checkpoint", 3), [("checkpoint", "must be an object, got 3 (a number)")]),
    ("name with a slash", _with("name", "a/b"),
     [("name", "may hold only letters, digits, spaces, '.', '_' and '-'")]),
    ("compile as 1", _with("compile", 1), [("compile", "must be true or false, got 1 (a number)")]),
    ("unknown schedule", _with("schedule", {"name": "step"}),
     [("schedule.name", "must be one of 'constant', 'cosine' or 'onecycle', got \"step\" (a string)")]),
    ("several problems at once", {"model": {"name": "mlp", "depth": 3}, "data": {"name": "digits"},
                                  "optimizer": {"name": "sgd", "lr": 0}, "epochs": 0},
     [("model.depth", "unknown field"), ("optimizer.lr", "must be > 0.0"), ("epochs", "must be >= 1")]),
]  # fmt: skip


def test_the_table_is_big_enough() -> None:
    assert len(BAD_SPECS) >= 15


@pytest.mark.parametrize(("spec", "expected"), [(s, e) for _, s, e in BAD_SPECS],
                         ids=[name for name, _, _ in BAD_SPECS])  # fmt: skip
def test_bad_spec_names_each_field(spec: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert sorted(err.value.problems) == sorted(expected)
    for field, msg in expected:
        assert f"{field}: {msg}" in str(err.value)


def test_the_torch_free_list_of_torchvision_models_is_the_installed_ones() -> None:
    import torchvision

    from torchyard.contracts.torchvision_names import CLASSIFIERS

    assert set(torchvision.models.list_models(module=torchvision.models)) == CLASSIFIERS


def test_not_an_object() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec([1, 2])
    assert err.value.problems == [("spec", "must be a JSON object")]


def test_defaults_are_written_out_and_round_trip() -> None:
    spec = parse_spec(
        {"model": {"name": "mlp"}, "data": {"name": "digits"}, "optimizer": {"name": "sgd"}}
    )
    d = spec_to_dict(spec)
    assert d["batch_size"] == 128 and d["checkpoint"]["keep_last"] == 3 and d["precision"] == "auto"
    assert parse_spec(json.loads(json.dumps(d))) == spec
    assert spec.optimizer.learning_rate == 0.01 and spec.model.hidden_sizes == [128]


def test_missing_dataset_files(tmp_path: Path) -> None:
    assert missing_dataset_files("digits", tmp_path) == []
    assert missing_dataset_files("synthetic", tmp_path) == []
    missing = missing_dataset_files("cifar10", tmp_path)
    assert tmp_path / "cifar-10-batches-py/data_batch_1" in missing and len(missing) == 7
    # torchvision's whole layout, as the README lists it: the batches and batches.meta
    assert tmp_path / "cifar-10-batches-py/batches.meta" in missing
    assert len(missing_dataset_files("fashion_mnist", tmp_path)) == 4
    # gzipped idx files count as present
    write_mnist(tmp_path, n_train=10, n_test=10, gz=True)
    assert missing_dataset_files("mnist", tmp_path) == []
    (tmp_path / "MNIST/raw/t10k-labels-idx1-ubyte.gz").unlink()
    assert missing_dataset_files("mnist", tmp_path) == [
        tmp_path / "MNIST/raw/t10k-labels-idx1-ubyte"
    ]


def test_cli_refuses_a_bad_spec_without_torch_and_writes_nothing(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.json", _with("optimizer.lr", -1) | {"epochs": 0})
    run_dir = tmp_path / "run"
    # -X importtime would be noisy; instead check torch is never imported on this path.
    code = (
        "import sys, runpy; sys.argv=['trainer','--spec',sys.argv[1],'--run-dir',sys.argv[2]];"
        "import torchyard.trainer.cli as c; rc=c.main(sys.argv[1:]);"
        "print('torch' in sys.modules); sys.exit(rc)"
    )
    p = subprocess.run([sys.executable, "-c", code, str(spec), str(run_dir)], env=trainer_env(),
                       cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == exitcodes.BAD_SPEC, p.stderr
    assert "optimizer.lr: must be > 0.0" in p.stderr and "epochs: must be >= 1" in p.stderr
    assert p.stdout.strip() == "False"
    assert not run_dir.exists()


def test_cli_usage_errors_exit_2(tmp_path: Path) -> None:
    from torchyard.trainer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--spec", str(tmp_path / "x.json")])  # no --run-dir
    assert e.value.code == exitcodes.BAD_SPEC
    assert main(["--spec", str(tmp_path / "absent.json"), "--run-dir", str(tmp_path / "r")]) == 2
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["--spec", str(tmp_path / "bad.json"), "--run-dir", str(tmp_path / "r")]) == 2
    ok = write_spec(tmp_path / "ok.json", make_spec())
    assert (
        main(
            [
                "--spec",
                str(ok),
                "--run-dir",
                str(tmp_path / "r"),
                "--resume",
                str(tmp_path / "nope.pt"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "r").exists()


def test_cli_refuses_a_batch_the_ranks_cannot_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchyard.trainer.cli import main

    ok = write_spec(tmp_path / "ok.json", make_spec(batch_size=64))  # world_size 1: valid
    monkeypatch.setenv("WORLD_SIZE", "3")  # but torchrun started 3 ranks
    assert main(["--spec", str(ok), "--run-dir", str(tmp_path / "r")]) == exitcodes.BAD_SPEC
    assert "batch_size 64 must be divisible by world_size (3)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_cifar10_needs_batches_meta_and_the_trainer_reads_the_batches_only(tmp_path: Path) -> None:
    from torchyard.trainer.data import load_dataset

    write_cifar(tmp_path, per_batch=4, n_test=3)
    spec = parse_spec(make_spec() | {"data": {"name": "cifar10"}, "model": {"name": "lenet"}})
    assert missing_dataset_files("cifar10", tmp_path) == []
    ds = load_dataset(spec.data, tmp_path, seed=0)  # batches.meta is not read as a batch
    assert (len(ds.train), len(ds.val)) == (20, 3)
    (tmp_path / "cifar-10-batches-py/batches.meta").unlink()
    assert missing_dataset_files("cifar10", tmp_path) == [
        tmp_path / "cifar-10-batches-py/batches.meta"
    ]


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("model.hiden", [64], "unknown field (did you mean 'hidden'?)"),
        ("schedule.warmup", 10, "unknown field (did you mean 'warmup_steps'?)"),
        ("checkpoint.every_epoch", 2, "unknown field (did you mean 'every_epochs'?)"),
        ("batchsize", 64, "unknown field (did you mean 'batch_size'?)"),
        ("lr", 0.1, "unknown field (did you mean 'optimizer.lr'?)"),  # a field of another section
        ("learning_rate", 0.1, "unknown field"),  # nothing close: no guess
    ],
)
def test_an_unknown_field_says_which_was_meant(path: str, value: Any, expected: str) -> None:
    spec = _with(path, value) | ({"schedule": {"warmup": 10}} if path == "schedule.warmup" else {})
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert err.value.problems == [(path, expected)]


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("optimizer.lr", "1e-3", 'must be a number, got "1e-3" (a string)'),
        ("seed", True, "must be an integer, got true (a boolean)"),
        ("epochs", None, "must be an integer, got null"),
        ("model.hidden", {"a": 1}, 'must be a list, got {"a": 1} (an object)'),
        ("name", ["x" * 100], 'must be a string, got ["' + "x" * 57 + "… (a list)"),
        # a union's members are one field, not `init.checkpoint.constrained-int`
        ("init", {"from_job": "a" * 32, "checkpoint": 1.5}, None),
    ],
)
def test_a_wrong_type_shows_the_value_received(path: str, value: Any, expected: str | None) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_with(path, value))
    if expected is None:
        assert {f for f, _ in err.value.problems} == {"init.checkpoint"}
        assert all("got 1.5 (a number)" in m for _, m in err.value.problems)
    else:
        assert err.value.problems == [(path, expected)]


def test_training_set_sizes_are_the_trainers(tmp_path: Path) -> None:
    """train_samples (what the submit warns with) is the size the trainer's split gives."""
    from torchyard.contracts.datasets import size_warnings, train_samples
    from torchyard.trainer.data import load_dataset

    write_mnist(tmp_path, n_train=30, n_test=10, gz=True)
    cases = [
        ({"name": "digits"}, 1438),
        ({"name": "digits", "val_fraction": 0.5}, 899),  # round(898.5) is 898
        ({"name": "synthetic", "size": 64, "shape": [4]}, 51),
        ({"name": "mnist"}, 30),  # from the idx header in the data root
    ]
    for data, n in cases:
        spec = parse_spec(make_spec() | {"data": data})
        assert train_samples(spec.data, tmp_path) == n, data
        assert len(load_dataset(spec.data, tmp_path, seed=0).train) == n, data
    spec = parse_spec(make_spec() | {"data": {"name": "mnist"}})
    assert train_samples(spec.data) == 60_000  # the official count without the files
    assert size_warnings(parse_spec(make_spec() | {"batch_size": 1438})) == []
    [(field, message)] = size_warnings(parse_spec(make_spec() | {"batch_size": 1440}))
    assert field == "batch_size" and "training set's 1438 samples" in message


def test_50000_unknown_fields_are_counted_not_validated_one_by_one() -> None:
    """pydantic's validation holds the GIL for the whole call (no other API thread runs):
    parse_spec hands it a bounded number of unknown fields per section and counts the rest,
    in the top level and in a section alike."""
    valid = make_spec()
    top = {**valid, **{f"f{i}": 1 for i in range(50_000)}}
    bounded, dropped = without_excess_unknown(JobSpec, top)
    assert dropped == 50_000 - MAX_LISTED - 3 and len(bounded) == len(valid) + MAX_LISTED + 3
    assert without_excess_unknown(JobSpec, valid) == (valid, 0)
    with pytest.raises(SpecError) as e:
        parse_spec(top)
    assert len(e.value.problems) == MAX_LISTED + 1
    assert e.value.problems[-1] == ("spec", "and 49980 more unknown fields (f20, f21, f22, …)")

    inner = {**valid, "optimizer": {**valid["optimizer"], **{f"o{i}": 1 for i in range(5_000)}}}
    with pytest.raises(SpecError) as e:
        parse_spec(inner)
    assert e.value.problems[0] == ("optimizer.o0", "unknown field")
    assert e.value.problems[-1][1].startswith("and 4980 more unknown fields (optimizer.o20,")
