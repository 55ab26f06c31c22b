"""The workbook's datasets: an offline default that really learns, and CIFAR-10 where available.

Every notebook must run on a machine without internet, so the default is
:class:`SyntheticImages`: small images made from a seed, in classes a small CNN learns to tell
apart in a few epochs. :func:`load_cifar10` gives the real CIFAR-10 when it is on disk (or when
you allow a download). Notebook 06's input pipeline lives here too: :func:`augment` (a typical
per-sample augmentation, in plain torch) and the datasets its DataLoader workers read
(:class:`AugmentedImages`, :class:`WorkerSeeds`, :class:`CountingDataset`, :class:`WhoLoads`): a
worker that is not forked (:func:`mgtutor.build.loader_start_method`) imports its dataset's class
by name, which a class defined in a notebook cell does not have::

    train = mgtutor.data.default_dataset("train")
    test = mgtutor.data.default_dataset("test")
    x, y = train[0]  # a (3, 16, 16) float32 image and its label
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from torchvision.datasets import CIFAR10

__all__ = [
    "AugmentedImages",
    "CountingDataset",
    "SyntheticImages",
    "WhoLoads",
    "WorkerSeeds",
    "augment",
    "default_dataset",
    "load_cifar10",
]

# Each seed owns three generator streams, so the prototypes never depend on the split and the
# train and test samples are separate draws: seed * 3 + 0 / 1 / 2.
_STREAMS = {"prototypes": 0, "train": 1, "test": 2}
_MAX_SHIFT = 2  # pixels; enough that memorising pixel positions is not the whole task


class SyntheticImages(Dataset[tuple[Any, int]]):
    """Synthetic image classification data, made offline and deterministically from a seed.

    Each class has a smooth random pattern (its prototype): a pattern common to all classes plus
    a fainter one of its own. A sample is its class's prototype shifted by up to 2 pixels in each
    direction, with random contrast and brightness, plus Gaussian pixel noise. The same ``seed``
    gives the same prototypes for both splits, so a model trained on ``split="train"`` is tested
    on new draws of the same classes with ``split="test"``.

    Args:
        n: number of samples.
        num_classes: number of classes; labels are balanced (they differ in count by at most 1).
        image_size: height and width of the images, in pixels.
        channels: number of image channels.
        noise: standard deviation of the pixel noise; the prototypes have standard deviation 1.
        seed: seed of the data; all randomness comes from ``torch.Generator`` objects seeded
            from it, never from the global random state.
        split: ``"train"`` or ``"test"``.
        transform: applied to each image in ``__getitem__``, if given.

    Attributes:
        images: all images, a float32 tensor of shape ``(n, channels, image_size, image_size)``.
        labels: all labels, an int64 tensor of shape ``(n,)``.
        classes: the class names, ``["pattern 0", "pattern 1", ...]``.

    Raises:
        ValueError: if an argument is out of its allowed range.

    Example:
        >>> data = SyntheticImages(100, seed=1)
        >>> image, label = data[0]
        >>> image.shape, data.classes[label]
        (torch.Size([3, 16, 16]), 'pattern 0')
    """

    def __init__(
        self,
        n: int = 2048,
        *,
        num_classes: int = 10,
        image_size: int = 16,
        channels: int = 3,
        noise: float = 0.5,
        seed: int = 0,
        split: str = "train",
        transform: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        for name, value, low in [
            ("n", n, 1),
            ("num_classes", num_classes, 2),
            ("image_size", image_size, 4),
            ("channels", channels, 1),
        ]:
            if value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not noise >= 0:  # also rejects NaN
            raise ValueError(f"noise must be >= 0, got {noise!r}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")

        self.transform = transform
        self.classes = [f"pattern {k}" for k in range(num_classes)]
        self.prototypes = _prototypes(num_classes, channels, image_size, seed)

        g = torch.Generator().manual_seed(seed * 3 + _STREAMS[split])
        self.labels = (torch.arange(n) % num_classes)[torch.randperm(n, generator=g)]
        shifts = torch.randint(-_MAX_SHIFT, _MAX_SHIFT + 1, (n, 2), generator=g).tolist()
        contrast = torch.empty(n, 1, 1, 1).uniform_(0.7, 1.3, generator=g)
        brightness = 0.3 * torch.randn(n, 1, 1, 1, generator=g)
        pixel_noise = noise * torch.randn(n, channels, image_size, image_size, generator=g)

        shifted = torch.stack(
            [
                torch.roll(self.prototypes[label], shifts=(dy, dx), dims=(1, 2))
                for label, (dy, dx) in zip(self.labels.tolist(), shifts, strict=True)
            ]
        )
        self.images = (contrast * shifted + brightness + pixel_noise).float()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


def _prototypes(num_classes: int, channels: int, size: int, seed: int) -> torch.Tensor:
    """One smooth pattern per class, shape (num_classes, channels, size, size), std 1 each."""
    g = torch.Generator().manual_seed(seed * 3 + _STREAMS["prototypes"])
    # Upsampling coarse noise makes blobs a few pixels wide: shapes a convolution can pick up,
    # which survive the small shifts better than pixel-level noise would. A pattern shared by
    # all classes makes them look alike, so that a model needs a few epochs, not one, to learn.
    shared = torch.randn(1, channels, 4, 4, generator=g)
    coarse = shared + 0.5 * torch.randn(num_classes, channels, 4, 4, generator=g)
    smooth = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    smooth = smooth - smooth.mean(dim=(1, 2, 3), keepdim=True)
    return smooth / smooth.std(dim=(1, 2, 3), keepdim=True)


def default_dataset(split: str = "train", n: int | None = None) -> SyntheticImages:
    """The workbook's standard dataset: 2048 training or 512 test images, seed 0.

    Args:
        split: ``"train"`` or ``"test"``.
        n: number of samples, instead of the standard size for the split.

    Returns:
        A :class:`SyntheticImages` with 10 classes of 3x16x16 images.

    Raises:
        ValueError: if ``split`` or ``n`` is invalid.

    Example:
        >>> len(default_dataset("test"))
        512
    """
    if n is None:
        n = 512 if split == "test" else 2048
    return SyntheticImages(n, split=split)


def augment(image: torch.Tensor, size: int = 32) -> torch.Tensor:
    """One random augmentation of a ``(channels, h, w)`` image, as a typical pipeline does it.

    A random resized crop (60-100% of the area, aspect 3/4 to 4/3) to ``size`` x ``size``, a
    horizontal flip half the time, a rotation of up to 10 degrees, brightness, contrast and
    saturation each scaled by 0.7-1.3, and a 3x3 Gaussian blur of sigma 0.1-1 (SimCLR's
    augmentations, torchvision's ``RandomResizedCrop``, ``RandomRotation``, ``ColorJitter`` and
    ``GaussianBlur``, written in plain torch). Its random numbers come from torch's global
    generator, so ``torch.manual_seed`` and a DataLoader worker's seed decide them.

    Example:
        >>> augment(torch.zeros(3, 16, 16)).shape
        torch.Size([3, 32, 32])
    """
    _, h, w = image.shape
    u = torch.rand(9).tolist()
    area = h * w * (0.6 + 0.4 * u[0])
    ratio = math.exp(math.log(3 / 4) + math.log(16 / 9) * u[1])
    ch, cw = min(h, round(math.sqrt(area / ratio))), min(w, round(math.sqrt(area * ratio)))
    top, left = int(u[2] * (h - ch + 1)), int(u[3] * (w - cw + 1))
    crop = image[None, :, top : top + ch, left : left + cw]
    out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)
    if u[4] < 0.5:
        out = out.flip(-1)
    angle = math.radians(10 * (2 * u[5] - 1))
    cos, sin = math.cos(angle), math.sin(angle)
    theta = torch.tensor([[[cos, -sin, 0.0], [sin, cos, 0.0]]])
    out = F.grid_sample(
        out, F.affine_grid(theta, list(out.shape), align_corners=False), align_corners=False
    )
    brightness, contrast, saturation = (0.7 + 0.6 * torch.rand(3)).tolist()
    out = out * brightness
    grey = out.mean(dim=1, keepdim=True)
    out = (out - grey) * saturation + grey
    mean = out.mean()
    out = (out - mean) * contrast + mean
    sigma = 0.1 + 0.9 * u[6]
    taps = torch.exp(-(torch.arange(-1.0, 2.0) ** 2) / (2 * sigma**2))
    kernel = (taps[:, None] * taps[None, :] / taps.sum() ** 2).expand(out.shape[1], 1, 3, 3)
    out = F.conv2d(F.pad(out, (1, 1, 1, 1), mode="reflect"), kernel, groups=out.shape[1])
    return out[0]


class AugmentedImages(Dataset[tuple[torch.Tensor, int, int]]):
    """``n`` of the workbook's synthetic images, augmented anew on every access, with their index.

    Example:
        >>> image, label, index = AugmentedImages(8)[3]
        >>> tuple(image.shape), index
        ((3, 32, 32), 3)
    """

    def __init__(self, n: int) -> None:
        self.base = SyntheticImages(n, seed=0)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        image, label = self.base[index]
        return augment(image), label, index


class WorkerSeeds(Dataset[torch.Tensor]):
    """4 samples, each ``[worker id, the worker's seed, torch's initial seed]`` where it loaded."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        if info is None:
            raise RuntimeError(
                "WorkerSeeds reports a DataLoader worker's seeds: read it through a DataLoader "
                "with num_workers >= 1 (in the main process there is no worker)"
            )
        return torch.tensor([info.id, info.seed, torch.initial_seed()])


class WhoLoads(Dataset[torch.Tensor]):
    """``n`` samples, each ``[pid, torch threads]`` of the process that loaded it.

    Example:
        >>> WhoLoads(2)[0].tolist() == [os.getpid(), torch.get_num_threads()]
        True
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([os.getpid(), torch.get_num_threads()])


class CountingDataset(Dataset[int]):
    """``n`` samples (their indices) that count their ``__getitem__`` calls in ``loaded.value``.

    The counter is shared memory made by ``start_method``'s context, the one the DataLoader's
    workers start with: each worker counts into it.
    """

    def __init__(self, n: int, start_method: str | None = None) -> None:
        self.n = n
        self.loaded = multiprocessing.get_context(start_method).Value("i", 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        with self.loaded.get_lock():
            self.loaded.value += 1
        return index


def load_cifar10(
    root: str | os.PathLike[str] = "data",
    *,
    train: bool = True,
    download: bool = False,
    transform: Callable[[Any], Any] | None = None,
) -> CIFAR10:
    """CIFAR-10 from ``root``, as a ``torchvision.datasets.CIFAR10``.

    Args:
        root: folder that holds (or will hold) ``cifar-10-batches-py``.
        train: the 50,000 training images if True, else the 10,000 test images.
        download: fetch the data (about 170 MB) from the internet if it is not under ``root``.
        transform: applied to each PIL image; ``torchvision.transforms.ToTensor()`` if None.

    Returns:
        The dataset; each item is ``(image, label)``.

    Raises:
        FileNotFoundError: if the data is not under ``root`` and ``download`` is False.
        ImportError: torchvision does not import here (the message says how to install it).

    Example:
        >>> test = load_cifar10("data", train=False, download=True)  # doctest: +SKIP
    """
    from mgtutor.build import this_build

    build = this_build()
    if build.torchvision is None:
        raise ImportError(
            f"load_cifar10 needs torchvision, which does not import here "
            f"({build.torchvision_error}). For torch {build.torch}: {build.torchvision_install}; "
            "or use mgtutor.data.SyntheticImages, which needs nothing more."
        )
    import torchvision  # here, so that the offline dataset does not need torchvision

    if transform is None:
        transform = torchvision.transforms.ToTensor()
    try:
        return torchvision.datasets.CIFAR10(
            root, train=train, download=download, transform=transform
        )
    except RuntimeError as err:  # torchvision's "Dataset not found or corrupted"
        if download:
            raise
        where = os.path.join(os.path.abspath(root), "cifar-10-batches-py")
        raise FileNotFoundError(
            f"CIFAR-10 not found (or incomplete) in {where}. Pass download=True to fetch it "
            "(about 170 MB from the internet), or use mgtutor.data.SyntheticImages, "
            "which works offline."
        ) from err
