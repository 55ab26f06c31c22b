"""Tests for mgtutor.data: the offline dataset is deterministic, balanced and learnable."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from mgtutor.build import this_build
from mgtutor.data import SyntheticImages, default_dataset, load_cifar10
from mgtutor.models import small_cnn


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Two cores: extra intra-op threads only add contention for these small tensors. Restored
    # afterwards so that the setting does not leak into other test modules.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def train_set() -> SyntheticImages:
    return default_dataset("train")


@pytest.fixture(scope="module")
def test_set() -> SyntheticImages:
    return default_dataset("test")


def test_same_seed_gives_identical_data() -> None:
    a = SyntheticImages(64, seed=3)
    b = SyntheticImages(64, seed=3)
    assert torch.equal(a.images, b.images)
    assert torch.equal(a.labels, b.labels)


def test_different_seed_gives_different_data() -> None:
    a = SyntheticImages(64, seed=3)
    b = SyntheticImages(64, seed=4)
    assert not torch.equal(a.images, b.images)
    assert not torch.equal(a.prototypes, b.prototypes)


def test_global_rng_is_neither_used_nor_consulted() -> None:
    torch.manual_seed(1)
    a = SyntheticImages(32)
    after_a = torch.rand(1)
    torch.manual_seed(2)
    b = SyntheticImages(32)
    assert torch.equal(a.images, b.images)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(1), after_a)  # making `a` drew nothing from the global RNG


def test_shapes_dtypes_and_items() -> None:
    data = SyntheticImages(30, num_classes=3, image_size=8, channels=1)
    assert len(data) == 30
    assert data.images.shape == (30, 1, 8, 8)
    assert data.images.dtype == torch.float32
    assert data.labels.shape == (30,)
    assert data.labels.dtype == torch.int64
    assert data.classes == ["pattern 0", "pattern 1", "pattern 2"]
    image, label = data[5]
    assert torch.equal(image, data.images[5])
    assert isinstance(label, int) and label == data.labels[5].item()


def test_transform_is_applied_to_the_image_only() -> None:
    data = SyntheticImages(10, transform=lambda x: x * 0 + 7)
    image, label = data[2]
    assert torch.all(image == 7)
    assert label == data.labels[2].item()


def test_labels_are_balanced_and_shuffled(train_set: SyntheticImages) -> None:
    counts = torch.bincount(train_set.labels, minlength=10)
    assert counts.max() - counts.min() <= 1
    assert not torch.equal(train_set.labels, torch.arange(len(train_set)) % 10)
    uneven = SyntheticImages(23, num_classes=4)
    counts = torch.bincount(uneven.labels, minlength=4)
    assert counts.tolist() == [6, 6, 6, 5]


def test_default_sizes() -> None:
    assert len(default_dataset("train")) == 2048
    assert len(default_dataset("test")) == 512
    assert len(default_dataset("test", n=40)) == 40


def test_train_and_test_are_different_draws_of_the_same_classes(
    train_set: SyntheticImages, test_set: SyntheticImages
) -> None:
    assert torch.equal(train_set.prototypes, test_set.prototypes)
    # Same size, same seed: only the split tells them apart, so the draws must differ.
    small_train, small_test = SyntheticImages(64), SyntheticImages(64, split="test")
    assert not torch.equal(small_train.images, small_test.images)
    assert not torch.equal(small_train.labels, small_test.labels)
    # A nearest-class-mean classifier fit on train works on test only if the classes are shared.
    # Measured: 0.793 (chance: 0.1).
    means = torch.stack([train_set.images[train_set.labels == k].mean(0) for k in range(10)])
    distances = torch.cdist(test_set.images.flatten(1), means.flatten(1))
    accuracy = (distances.argmin(1) == test_set.labels).float().mean().item()
    assert accuracy > 0.6


def _accuracy(model: nn.Module, data: SyntheticImages) -> float:
    with torch.no_grad():
        return (model(data.images).argmax(1) == data.labels).float().mean().item()


def _fit(model: nn.Module, data: SyntheticImages, epochs: int, lr: float) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(data))
        for start in range(0, len(data), 64):
            batch = order[start : start + 64]
            loss = nn.functional.cross_entropy(model(data.images[batch]), data.labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def test_small_cnn_learns(train_set: SyntheticImages, test_set: SyntheticImages) -> None:
    torch.manual_seed(0)
    model = small_cnn()
    before = _accuracy(model, test_set)
    _fit(model, train_set, epochs=5, lr=3e-3)
    after = _accuracy(model, test_set)
    # Measured: 0.982 held-out accuracy after 5 epochs (0.945 to 0.984 over 3 data seeds x 3
    # model seeds); by epoch: 0.37, 0.80, 0.88, 0.99, 0.99.
    assert before < 0.3
    assert after > 0.9


def test_linear_model_learns(train_set: SyntheticImages, test_set: SyntheticImages) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))
    _fit(model, train_set, epochs=2, lr=1e-3)
    # Measured: 0.996 held-out accuracy after 2 epochs (chance: 0.1).
    assert _accuracy(model, test_set) > 0.8


def test_more_noise_is_harder(train_set: SyntheticImages) -> None:
    noisy = SyntheticImages(512, noise=8.0, split="test")
    means = torch.stack([train_set.images[train_set.labels == k].mean(0) for k in range(10)])
    distances = torch.cdist(noisy.images.flatten(1), means.flatten(1))
    accuracy = (distances.argmin(1) == noisy.labels).float().mean().item()
    # Measured: 0.309 at noise 8 (0.553 at 4) against 0.793 at the default 0.5.
    assert accuracy < 0.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, r"n must be an integer >= 1, got 0"),
        ({"num_classes": 1}, r"num_classes must be an integer >= 2, got 1"),
        ({"image_size": 3}, r"image_size must be an integer >= 4, got 3"),
        ({"channels": 0}, r"channels must be an integer >= 1, got 0"),
        ({"noise": -0.1}, r"noise must be >= 0, got -0.1"),
        ({"noise": float("nan")}, r"noise must be >= 0, got nan"),
        ({"split": "val"}, r"split must be 'train' or 'test', got 'val'"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyntheticImages(**kwargs)  # type: ignore[arg-type]


def test_default_dataset_rejects_a_bad_split() -> None:
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        default_dataset("validation")


@pytest.mark.skipif(
    this_build().torchvision is None,
    reason=f"torchvision does not import here; {this_build().torchvision_install}",
)
def test_missing_cifar10_says_how_to_get_it(tmp_path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_cifar10(tmp_path, download=False)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "download=True" in message
    assert "170 MB" in message
    assert "SyntheticImages" in message
    assert not any(tmp_path.iterdir())  # nothing was written or fetched
