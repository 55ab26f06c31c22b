"""The workbook's models: the small CNN that every notebook, script, test and benchmark trains.

One definition, so a notebook's figures and a test's assertions are about the same network;
:func:`mlp` is the square linear stack the timing studies scale.
"""

from __future__ import annotations

from torch import nn

__all__ = ["mlp", "small_cnn"]


def small_cnn(
    num_classes: int = 10, channels: int = 3, *, batchnorm: bool = False
) -> nn.Sequential:
    """A two-convolution CNN small enough to train on CPU ranks in seconds.

    conv(channels->16) - [BN] - ReLU - maxpool 2 - conv(16->32) - [BN] - ReLU - global average
    pool - linear(32->num_classes). It accepts any image size (the pooling is adaptive); the
    workbook's data are 16x16. Without BatchNorm it has 5,418 parameters for 3 channels and 10
    classes (21,672 bytes of float32 gradients).

    ``batchnorm`` puts a ``BatchNorm2d`` after each convolution. The weights come from torch's
    global random state: seed it first for the same weights everywhere.
    """
    if num_classes < 1 or channels < 1:
        raise ValueError(
            f"num_classes and channels must be at least 1, got num_classes={num_classes}, "
            f"channels={channels}"
        )

    def norm(width: int) -> list[nn.Module]:
        return [nn.BatchNorm2d(width)] if batchnorm else []

    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        *norm(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        *norm(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def mlp(width: int = 512, depth: int = 6) -> nn.Sequential:
    """``depth`` square linear layers of ``width`` features with a ReLU between each two.

    The performance notebooks time it: its work per sample and its gradient size
    (``depth * (width**2 + width)`` float32 values) are easy to reason about and to scale.

    ValueError if ``width`` or ``depth`` is below 1.
    """
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be at least 1, got width={width}, depth={depth}")
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])
