"""The step-time model against ranks it runs: calibrate, predict, measure, and delete each term.

:func:`~mgtutor.experiments.step_calibrate.calibrate` (re-exported) measures this machine's 2 CPU
ranks. :func:`check` predicts and measures each configuration of :data:`CONFIGS`, interleaved
(every configuration once per round), and :func:`without` recomputes each prediction with one
term of the model deleted, so that a check can show the term is needed: outside the bound
without it, inside with it. Two kinds of configuration:

* real: :class:`~mgtutor.parallel.gpt_layer.GPTLayer` steps on the CPU, gloo between the ranks
  (its collectives use the cores that compute: nothing overlaps). They check the compute model's
  overall size, within a factor :data:`FACTOR` (why so wide: its comment). One rank's step is
  compared in CPU seconds, two ranks' in wall-clock time, each at the rate the ranks compute just
  before it (:func:`~mgtutor.experiments.step_calibrate.step_clock`,
  :func:`~mgtutor.experiments.step_calibrate.at_rate`).
* emulated: a GPU rank emulated (:mod:`mgtutor.measure.emulated`): device time and a link slept
  at declared rates, while torch's DDP, autograd and pipeline schedule order the work. They
  check what overlaps (the last micro-batch, the last bucket, TP's backward) and the pipeline's
  bubble and sends. Between sleeps the ranks still run Python, autograd and the wire thread's
  hand-offs on a core: eight busy processes per core stretched TP's median step by half.

A step is forward and backward (and DDP's reduction), no optimizer step. Both kinds share the
cores with whatever else runs, so the ranks count, over each window (the re-timings that set a
step's prediction, then the step: :mod:`~mgtutor.experiments.step_windows`), how crowded it was:
real ones the CPU other work used (:func:`~mgtutor.measure.other_work.busy_seconds` less the
ranks' own), emulated ones the time their threads waited for a core; a configuration is held to
its bound only where its median window was at most :data:`CROWDED` (:attr:`Measured.asserted`),
and a real one also needs a calibration other work left alone (:func:`calibrate_beside`). Never
the load average: it lags, and misses work that starts after it is read.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from mgtutor.experiments.step_calibrate import (
    CHECK_MODEL,
    at_rate,
    calibrate,
    needs_gloo_ranks,
    step_clock,
    with_latencies,
)
from mgtutor.experiments.step_windows import WINDOW, measure_rank, window_crowding
from mgtutor.measure.emulated import emulated_device
from mgtutor.plan.machine import Hardware, Link, Software, StepTime
from mgtutor.plan.planner import plan
from mgtutor.plan.shape import Transformer
from mgtutor.plan.step_time import step_time

__all__ = [
    "BOUND",
    "FACTOR",
    "CONFIGS",
    "CROWDED",
    "DEEP_MODEL",
    "EMULATED_MODEL",
    "Config",
    "Measured",
    "calibrate",
    "calibrate_beside",
    "check",
    "emulated_hardware",
    "predict",
    "runnable",
    "window_crowding",
    "without",
]

#: The declared shape of the emulated configurations (4 GPT layers, 512 tokens a micro-batch).
EMULATED_MODEL = Transformer(layers=4, hidden=1024, heads=16, seq_len=512, micro_batch=1)
#: More, narrower layers for the accumulation check: the gradients' window behind the last
#: backward grows to 7/8 of it (a bucket per layer), so hiding them behind every micro-batch's
#: backward instead moves the step by a third.
DEEP_MODEL = Transformer(layers=8, hidden=768, heads=12, seq_len=512, micro_batch=1)
#: How far an emulated configuration's prediction may be from the measured median (sleeps).
BOUND = 0.15
#: A real configuration's prediction may be up to this many times the measured median, or down
#: to its inverse: real CPU steps and their calibration vary from run to run by more than DDP's
#: gloo traffic, so no bound checks a term there; a factor of 2 holds every uncrowded run
#: measured and checks the compute model's overall size (the emulated configurations check
#: terms). The runs, and what a compute model 2x or 3x too fast does: the README's Benchmarks
#: section, from benchmarks/step_check_spread.py.
FACTOR = 2.0
#: The crowding of a configuration's median window (the timings that set a step's prediction,
#: then the step) above which its error is printed, not asserted (:func:`window_crowding`).
#: Real ranks: other work's CPU, in cores. c cores of it take at most c of each second from the
#: slower rank (all of it on its core), stretching a step by up to c / (1 - c): at most 11% at
#: 0.1. Emulated ranks sleep most of a step, and other work fills the cores they leave idle
#: (1.6-1.9 cores on a shared machine) without taking from them; other work "beyond the cores
#: they leave idle" says nothing either: measured, theirs and the others' CPU add up to at most
#: the cores, so it is never above 0. What crowding takes from an emulated step is a rank's
#: thread kept off a core while ready to run: a step of wall-clock T whose ranks' threads
#: waited w for a core in all would have taken at least T - w uncrowded. w is measured over the
#: window, about 1.25 steps (DDP, 1 micro-batch), so at 0.1 of it a step is stretched by at most
#: about 14%: a deletion of -30% then reads -39%, one of +35% reads +18%, both outside the 15%
#: bound (a +30% one would read +14%: the shapes keep positive ones at +35% or more). Waits
#: behind the ranks' own threads count as well (towards NOT CHECKED, never towards a pass);
#: where the kernel does not say (not Linux), the rule for real ranks holds them. In at least
#: half the windows, so in the median step.
CROWDED = 0.1


@dataclass(frozen=True)
class Config:
    """One configuration: dp x tp x pp ranks, micro-batches, and what its check deletes.

    Attributes:
        emulated: an emulated GPU rank (:mod:`mgtutor.measure.emulated`), else real CPU work.
        model: the shape (declared, when emulated).
        link: an emulated link's bytes/s.
        rate: the emulated device's products, FLOP/s.
        slow_wgrad: the emulated device computes the column-parallel weight gradients this many
            times slower (a longer product for TP's backward all-reduce to hide behind).
        deletions: the terms :func:`without` deletes for this configuration's check.
    """

    name: str
    dp: int
    tp: int
    pp: int
    micro_batches: int
    emulated: bool = False
    model: Transformer = CHECK_MODEL
    link: float = 0.0
    slow_wgrad: float = 1.0
    rate: float = 2e12
    deletions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp


CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("one process", 1, 1, 1, 1),
        Config("DDP, 2 ranks", 2, 1, 1, 1),
        Config("TP, 2 ranks", 1, 2, 1, 1),
        Config("1F1B, 2 stages, 2 micro-batches", 1, 1, 2, 2),
        Config("emulated DDP, 4 micro-batches", 2, 1, 1, 4, True, DEEP_MODEL, 1.0e9,
               slow_wgrad=4.0, rate=4e12, deletions=("dp", "last micro-batch")),
        Config("emulated DDP, 1 micro-batch", 2, 1, 1, 1, True, EMULATED_MODEL, 2.0e9,
               slow_wgrad=2.0, deletions=("dp", "dp overlap")),
        Config("emulated TP, backward overlapped", 1, 2, 1, 1, True, EMULATED_MODEL, 0.15e9,
               slow_wgrad=16.0, deletions=("tp", "tp overlap")),
        Config("emulated 1F1B, 2 stages, slow sends", 1, 1, 2, 2, True, EMULATED_MODEL, 0.05e9,
               deletions=("pp",)),
        Config("emulated 1F1B, 2 stages, fast sends", 1, 1, 2, 2, True, EMULATED_MODEL, 3e9,
               deletions=("bubble",)),
    )
}  # fmt: skip

_SMALL = ("all_reduce", "send")
#: What the CPU ranks run: GPTLayer without dropout, nothing DDP-specific changed.
REAL = Software(tp_overlap="none", dropout=False, optimizer=False)


def emulated_hardware(config: Config, wire_latency: float = 0.0) -> Hardware:
    """The emulated device and link of ``config``: every product at ``config.rate``, the
    column-parallel weight gradients ``slow_wgrad`` times slower; the wire's bytes/s and its
    latency per transfer (measured). A pipeline's send takes bytes / bandwidth alone: the stamp
    it carries (:class:`~mgtutor.measure.emulated.Unstamp`) times its delivery from its start."""
    device = emulated_device(config.model, config.tp, config.rate, config.slow_wgrad)
    link = Link(config.link or 1e12, wire_latency, p2p_latency=0.0)
    return Hardware("emulated GPU ranks", device, link, link, gpus_per_node=2, memory=10**12)


def _software(config: Config) -> Software:
    if not config.emulated:
        return REAL
    layer = 4 * 12 * config.model.hidden**2  # one layer's float32 weights: a bucket
    return Software(dropout=False, optimizer=False, bucket_view=True, bucket_bytes=layer,
                    first_bucket_bytes=layer)  # fmt: skip


def _plan(config: Config) -> Any:
    return plan(
        config.model, config.ranks, 10**12, dp=config.dp, tp=config.tp, pp=config.pp,
        precision="fp32", micro_batches=config.micro_batches,
    )  # fmt: skip


def predict(config: Config, hardware: Hardware) -> StepTime:
    """The model's step of ``config`` on ``hardware`` (an emulated one for emulated configs)."""
    return step_time(_plan(config), hardware, software=_software(config))


def without(config: Config, hardware: Hardware, term: str) -> float:
    """The predicted seconds of ``config`` with ``term`` deleted from the model: a part
    ("memory-bound", "tp", "pp", "bubble", "dp", "copies", "matmul"), an overlap ("tp overlap",
    "dp overlap": nothing hides), "last micro-batch" (gradients hide behind every micro-batch's
    backward, as the model of issue 35 had it) or "last bucket" (the last bucket hides too)."""
    t = predict(config, hardware)
    if term in t.parts:
        return t.total - t.parts[term]
    d, m = t.details, config.micro_batches
    if term == "tp overlap":
        return step_time(
            _plan(config), hardware, software=replace(_software(config), tp_overlap="none")
        ).total
    if term == "dp overlap":
        return t.total - t.parts["dp"] + d["dp_reduce"]
    if term == "last micro-batch":
        exposed = max(d["dp_reduce"] - m * d["dp_window"], d["dp_last_bucket"])
        return t.total - t.parts["dp"] + exposed
    if term == "last bucket":
        return t.total - t.parts["dp"] + max(d["dp_reduce"] - d["dp_window"], 0.0)
    raise ValueError(f"no term {term!r}: a part of {sorted(t.parts)} or an overlap rule")


def calibrate_beside(pool: Any, **kwargs: Any) -> tuple[Hardware, dict[str, Any], float]:
    """:func:`calibrate` on ``pool``, and the CPU other work used meanwhile, in cores, on the
    CPUs the ranks may run on (:class:`~mgtutor.measure.other_work.OtherWork`), also stored as
    ``extra["crowding"]``: a crowded calibration mis-measures every real configuration's
    prediction, so :func:`check` asserts none after one (emulated ones rest on declared rates
    and a wire latency re-timed beside their steps)."""
    from mgtutor.measure.other_work import OtherWork

    other = OtherWork()
    with other:
        hardware, extra = calibrate(pool, **kwargs)
    return hardware, {**extra, "crowding": other.cores}, other.cores


def runnable() -> tuple[str, ...]:
    """The names in :data:`CONFIGS` this torch runs: not the pipelines where ``PipelineStage``
    needs example inputs, which :func:`check` does not give."""
    import inspect

    from torch.distributed.pipelining import PipelineStage

    needs = inspect.signature(PipelineStage).parameters.get("input_args")
    # torch 2.4's PipelineStage requires input_args; 2.5 on infers them (pipelining/stage.py)
    if needs is not None and needs.default is inspect.Parameter.empty:
        return tuple(name for name, c in CONFIGS.items() if c.pp == 1)
    return tuple(CONFIGS)


@dataclass(frozen=True)
class Measured:
    """One configuration's measured step times (the slower rank's) and the prediction at the
    load of its steps, with each of its deletions' predictions, and the other work beside it:
    in its median window (``crowding``) and, for a real one, during the calibration its
    prediction rests on (``calibration``). Unmeasured: infinite, never asserted."""

    config: Config
    predicted: StepTime
    seconds: list[float]
    deleted: dict[str, float]
    crowding: float = math.inf
    calibration: float = math.inf

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def asserted(self) -> bool:
        """Whether it is held to :attr:`limit`: its median window's crowding
        (:func:`window_crowding`) at most :data:`CROWDED` and, real, the calibration's too."""
        return not self.why_not

    @property
    def why_not(self) -> str:
        """Why it is not asserted ("" where it is): the one place :data:`CROWDED` is applied."""
        if not self.crowding <= CROWDED and self.config.emulated:
            return (f"crowding {self.crowding:.2f} over {CROWDED}: its threads' wait for a core "
                    "as a share of the time, or other work's cores where the kernel does not say")
        if not self.crowding <= CROWDED:
            return f"other work {self.crowding:.2f} cores beside its steps (over {CROWDED})"
        if not self.config.emulated and not self.calibration <= CROWDED:
            return f"other work {self.calibration:.2f} cores beside the calibration"
        return ""

    @property
    def median(self) -> float:
        """The median measured step, in seconds."""
        return statistics.median(self.seconds)

    @property
    def error(self) -> float:
        """(predicted - measured median) / measured median."""
        return (self.predicted.total - self.median) / self.median

    def error_without(self, term: str) -> float:
        """The error with ``term`` deleted from the model."""
        return (self.deleted[term] - self.median) / self.median

    @property
    def limit(self) -> str:
        """What it is held to, in words, on the scale :meth:`shown` prints."""
        return f"within {BOUND:.0%}" if self.config.emulated else f"within x{FACTOR:g}"

    def shown(self, seconds: float) -> str:
        """A prediction of ``seconds`` against the measured median on its bound's scale:
        emulated, the signed error ("-12%"); real, predicted over measured ("x0.88"), since
        :data:`FACTOR` bounds that ratio either way."""
        ratio = seconds / self.median
        return f"{ratio - 1.0:+.0%}" if self.config.emulated else f"x{ratio:.2f}"

    def within(self, seconds: float) -> bool:
        """Whether a prediction of ``seconds`` holds against the measured median: emulated,
        within :data:`BOUND`; real, within a factor :data:`FACTOR` either way."""
        ratio = seconds / self.median
        if self.config.emulated:
            return abs(ratio - 1.0) <= BOUND
        return 1.0 / FACTOR <= ratio <= FACTOR

    @property
    def holds(self) -> bool:
        """Whether the prediction holds (:meth:`within`)."""
        return self.within(self.predicted.total)

    def holds_without(self, term: str) -> bool:
        """Whether the prediction with ``term`` deleted would hold as well (it must not)."""
        return self.within(self.deleted[term])


def check(
    pool: Any,
    hardware: Hardware,
    extra: dict[str, Any],
    *,
    rounds: int = 3,
    steps: int = 2,
    configs: tuple[str, ...] = tuple(CONFIGS),
    window: float = 0.05,
    calls: int = 5,
    min_seconds: float = 0.3,
) -> list[Measured]:
    """Predict each configuration, measure it on ``pool``'s 2 ranks, and delete its terms.

    Args:
        pool: a :class:`mgtutor.Pool` of 2 gloo ranks.
        hardware, extra: from :func:`calibrate_beside` on the same pool (real configurations
            are asserted only where ``extra["crowding"]`` is at most :data:`CROWDED`; after
            :func:`calibrate`, which does not count it, none is).
        rounds: rounds of measurement; each runs every configuration once, in turn.
        steps: timed steps per configuration per round, at least; a short one gets more, to
            fill ``min_seconds`` of predicted time.
        configs: the names in :data:`CONFIGS` to run.
        window: seconds of the reference product timed before each real step.
        calls: small collectives timed before each real step (each kind).

    Returns:
        One :class:`Measured` per configuration, in ``configs`` order, with the other work in
        its median window (``crowding``).
    """
    needs_gloo_ranks(pool)
    hw = {n: emulated_hardware(CONFIGS[n], extra["wire"]) if CONFIGS[n].emulated
          else hardware for n in configs}  # fmt: skip
    count = {
        n: max(steps, math.ceil(min_seconds / predict(CONFIGS[n], hw[n]).total)) for n in configs
    }
    got: dict[str, dict[str, list]] = {n: {} for n in configs}
    for _ in range(rounds):
        for name in configs:
            c = CONFIGS[name]
            ranks = list(range(c.ranks))
            run = pool.run(measure_rank, c, count[name], window, calls, ranks=ranks, quiet=True)
            per_rank = [r for r in run.results if r is not None]
            for i in range(count[name]):  # each step: the slower rank's
                got[name].setdefault("seconds", []).append(max(r["seconds"][i] for r in per_rank))
                crowding = window_crowding(per_rank, i, c.emulated)
                got[name].setdefault("crowding", []).append(crowding)
                for key in per_rank[0]:
                    if key not in ("seconds", *WINDOW) and per_rank[0][key]:
                        pick = min if key.startswith("rate_") else max
                        got[name].setdefault(key, []).append(pick(r[key][i] for r in per_rank))
    measured = []
    for name in configs:
        c, now = CONFIGS[name], hw[name]
        seconds = got[name]["seconds"]
        if c.emulated and got[name].get("wire"):
            now = emulated_hardware(c, statistics.fmean(got[name]["wire"]))
        elif not c.emulated:  # steps and rates on step_clock's clock
            rate = statistics.median(got[name][f"rate_{step_clock(c.ranks)}"])
            now = at_rate(hardware, extra, c.ranks, rate)
            small = {k: statistics.fmean(v) for k, v in got[name].items() if k in _SMALL}
            now = with_latencies(now, c.model, small) if small else now
        deleted = {term: without(c, now, term) for term in c.deletions}
        crowding = statistics.median(got[name]["crowding"])
        calibration = extra.get("crowding", math.inf)
        measured.append(Measured(c, predict(c, now), seconds, deleted, crowding, calibration))
    return measured
