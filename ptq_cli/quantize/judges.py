"""The judges of the quantization engine: each choice (activation ranges, the overflow fix, learned rounding, the
searched scales) made on 3/4 of the calibration images and kept only where it brings the model closer to FP32 on
the other 1/4 (quantize/policy.py)."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from typing import Any

import numpy as np

from ptq_cli.errors import PtqError, first_line
from ptq_cli.model_file import (
    resolve_threads,
)
from ptq_cli.quantize import overflow, ranges, reuse, rounding
from ptq_cli.quantize.budget import AFTER_CANDIDATES, AFTER_ROUNDING_SHARE, Deadline, StepClock
from ptq_cli.quantize.calibration import SEARCH_CHUNK_PIXELS, judged_images, write_qdq
from ptq_cli.quantize.job import Job
from ptq_cli.quantize.policy import chosen_method, closer_by_margin, even_draw, held_out_split, image_pixels, rounding_image_count, sqnr_figure
from ptq_cli.quantize.rounding import LEARNED, NEAREST
from ptq_cli.quantize.runs import (
    chunked_run,
    collected_batches,
    judged_in,
    judged_output,
    layer_by_layer_batches,
    probe_session,
    tensor_batches,
    tensor_outputs,
)
from ptq_cli.quantize.settings import (
    AUTO_METHOD,
    CANDIDATE_VALUES,
    METHOD_CANDIDATES,
    METHOD_MARGIN_DB,
    RANGE_SEARCH_PIXELS,
    ProgressCallback,
    QuantizationSettings,
    progress_after,
)
from ptq_cli.transforms.graph import (
    computing_only,
    part_after,
)
from ptq_cli.x86 import cpu as cpu_info

SEARCH_FED_BYTES = 512 << 20  # the tensors the range search keeps to feed the part after a scale, at most; past it, whole runs


def _float_memo(float_model, images: np.ndarray) -> rounding.FloatMemo:
    """Within one run (reuse.computed_once), the float model's sums of a layer's input rows, shared by the refinements
    of every quantized model made from the same float model and images: `--method auto`'s MinMax model, the model
    for VNNI CPUs that measures portability, and `ptq run`'s other 8-bit models."""
    @cache
    def prefix() -> bytes:
        return reuse.digest(float_model.SerializeToString(), repr((images.shape, str(images.dtype))).encode(), np.ascontiguousarray(images).tobytes()).encode()

    def memo(key: tuple, compute):
        return reuse.computed_once(lambda: reuse.digest(b"float rows", prefix(), repr(key).encode()), compute,
                                  size=lambda value: 0 if value[0] is None else value[0].nbytes)

    return memo


def float_outputs(float_model, name: str, input_name: str, images: np.ndarray, threads: int) -> np.ndarray:
    """The float model's tensor `name` on `images` (runs.tensor_outputs); within one run (reuse.computed_once), computed
    once for the judges that compare with it (the ranges, the overflow fix, the rounding, the range search)."""
    return reuse.computed_once(lambda: reuse.digest(b"float outputs", float_model.SerializeToString(), name.encode(), np.ascontiguousarray(images).tobytes(),
                                                    repr((images.shape, str(images.dtype), threads)).encode()),
                               lambda: _read_only(tensor_outputs(float_model, name, input_name, images, threads)), size=lambda outputs: outputs.nbytes)


def _read_only(values: np.ndarray) -> np.ndarray:
    values.setflags(write=False)  # shared by the judges: none may write into another's reference
    return values


def _quantized_source(layers: list[rounding.Layer]):
    """How the refinement reads the quantized model's layer inputs: layer by layer, unless a layer shares its codes or
    bias with an earlier one (changing it changes that one too), where each input is computed from the image."""
    biases = [layer.bias_codes for layer in layers if layer.bias_codes]
    shared = len({layer.codes for layer in layers}) < len(layers) or len(set(biases)) < len(biases)
    return tensor_batches if shared else layer_by_layer_batches


class _Refiner:
    """Learned rounding's passes over the same refinement images (`refine_rounding`'s first and its own-error retry): the
    float model, the images, the bar and, within a time budget, the last pass's clock (quantize/budget.py)."""

    def __init__(self, float_model, input_name: str, refining: np.ndarray, progress: ProgressCallback | None, deadline: Deadline | None) -> None:
        self.float_model, self.input_name, self.refining, self.progress, self.deadline = float_model, input_name, refining, progress, deadline
        self.threads = resolve_threads(None)
        self.clock: StepClock | None = None

    def __call__(self, model, own_error: bool = False) -> tuple[Any, list[rounding.LayerResult]]:
        found = rounding.find_layers(model)
        following = rounding.Refinement(self.float_model, _quantized_source(found)(self.input_name, self.refining, self.threads),
                                        collected_batches(self.input_name, self.refining, self.threads, [layer.float_input for layer in found]),
                                        len(self.refining), float_memo=_float_memo(self.float_model, self.refining))
        self.clock = StepClock(self.deadline, AFTER_ROUNDING_SHARE * self.deadline.seconds) if self.deadline is not None else None
        return rounding.refine(model, following, progress=self.progress, own_error=own_error, go_on=self.clock.another if self.clock else None)

    def stopped_note(self) -> list[str]:
        """What a time budget left out of the last pass, where it ended it early."""
        if self.clock is None or not self.clock.stopped:
            return []
        return [f"learned rounding: {self.clock.until.describe()} ended it after {self.clock.steps} layers; the layers after them keep their nearest codes"]


def refine_rounding(quantized, float_path: str, calibration: np.ndarray, input_name: str, settings: QuantizationSettings,  # noqa: PLR0913  the time budget
                    progress: ProgressCallback | None = None, deadline: Deadline | None = None) -> tuple[Any, QuantizationSettings, list[str]]:
    """(model, settings with the rounding decided, notes): learned codes and corrected biases where they bring
    the output closer to FP32 than nearest rounding on held-out calibration images (or where asked). Within a
    `deadline`, layer by layer while the next layer is expected to end before AFTER_ROUNDING_SHARE of it is left."""
    import onnx

    from ptq_cli.metrics import image_sqnr_db

    if deadline is not None and not deadline.fits(0.0, AFTER_ROUNDING_SHARE * deadline.seconds):
        return quantized, replace(settings, rounding=NEAREST), [f"learned rounding: not run ({deadline.describe()} was spent before it); "
                                                                 "weights rounded to nearest"]
    held_out, rest = held_out_split(calibration)
    if settings.rounding == LEARNED or len(held_out) == 0:
        rest = calibration  # nothing to judge with, or nothing to judge: every image refines
    refining = rest[even_draw(len(rest), rounding_image_count(image_pixels(calibration)))]
    float_model = onnx.load(float_path)
    nearest_model = onnx.ModelProto.FromString(quantized.SerializeToString())
    refine = _Refiner(float_model, input_name, refining, progress, deadline)
    try:
        refined, layers = refine(quantized)
    except Exception as error:  # noqa: BLE001  onnxruntime's and numpy's own errors: the user keeps the nearest-rounded model
        return nearest_model, replace(settings, rounding=NEAREST), [f"learned rounding: not applied ({first_line(error)}); weights rounded to nearest"]
    changed = sum(layer.codes_changed for layer in layers)
    notes = [f"learned rounding: {len(layers)} layers, {changed:,} of {sum(layer.codes for layer in layers):,} weight codes moved off nearest, "
             f"{sum(layer.bias_corrected for layer in layers)} biases corrected, from {len(refining)} calibration images", *refine.stopped_note()]
    stepped = sum(layer.codes_stepped_back for layer in layers)
    if stepped:
        notes.append(f"learned rounding: {stepped:,} codes stepped back towards zero to follow the pair rule")
    if settings.rounding == LEARNED or len(held_out) == 0:
        return refined, replace(settings, rounding=LEARNED), notes
    judged = judged_output(float_model)
    reference = float_outputs(float_model, judged, input_name, held_out, refine.threads)
    quantized_judged = judged_in(refined, judged)
    nearest_db = image_sqnr_db(reference, tensor_outputs(nearest_model, quantized_judged, input_name, held_out, refine.threads))
    learned_db = image_sqnr_db(reference, tensor_outputs(refined, quantized_judged, input_name, held_out, refine.threads))
    if learned_db <= nearest_db:  # the biases matched FP32's means past what the codes cost: each takes up its own layer's error
        with contextlib.suppress(Exception):  # onnxruntime's and numpy's own errors: the first pass's figures stand
            refined = refine(onnx.ModelProto.FromString(nearest_model.SerializeToString()), own_error=True)[0]
            learned_db = image_sqnr_db(reference, tensor_outputs(refined, quantized_judged, input_name, held_out, refine.threads))
            notes += ["learned rounding: each bias corrected for its own layer's codes only (matching FP32's means measured worse than nearest)",
                      *refine.stopped_note()]
    choice = LEARNED if learned_db > nearest_db else NEAREST
    measured = replace(settings, rounding=choice).with_evidence(rounding_nearest_db=sqnr_figure(nearest_db), rounding_learned_db=sqnr_figure(learned_db))
    verdict = f"image SQNR on {len(held_out)} held-out calibration images: {nearest_db:.2f} dB nearest, {learned_db:.2f} dB learned; kept {choice}"
    return (refined if choice == LEARNED else nearest_model), measured, [*notes, f"learned rounding: {verdict}"]


def choose_method(job: Job, settings: QuantizationSettings, overrides: dict | None,
                  progress: ProgressCallback | None) -> tuple[QuantizationSettings, list[str]]:
    """(settings with the activation ranges chosen, notes): each METHOD_CANDIDATES range calibrated on 3/4 of the
    calibration images (an even draw of them past CANDIDATE_VALUES activation values: `judged_images`), nearest-rounded,
    and judged by the image SQNR against FP32 on the other 1/4 (the scores before a final Softmax); `chosen_method` keeps
    one (MinMax unless a percentile measures better by a margin). A candidate onnxruntime cannot calibrate scores nothing."""
    import onnx

    from ptq_cli.metrics import image_sqnr_db

    split = judged_images(job)
    held_out, rest = split.held_out, split.calibrating
    if len(held_out) == 0 or len(rest) == 0:
        first = METHOD_CANDIDATES[0][0]
        return replace(settings, method=first, percentile=None), [f"method auto: {first} (too few calibration images to compare ranges)"]
    notes = [f"method auto: candidates calibrated on {len(rest)} of the {split.not_held_out} images not held out (an even draw within "
             f"{CANDIDATE_VALUES / 1e9:g} G activation values), the model kept on all {len(job.calibration)}"] if split.drawn else []
    threads = resolve_threads(None)
    float_model = onnx.load(job.source)
    judged = judged_output(float_model)
    reference = float_outputs(float_model, judged, job.input_name, held_out, threads)
    scores: list[tuple[str, float | None, float | None]] = []
    histograms: dict = {}  # the percentiles read off one collection of histograms
    # Within a time budget, the candidates after MinMax run while AFTER_CANDIDATES times MinMax's is still left after them.
    clock: StepClock | None = None
    skipped: list[str] = []
    began = time.monotonic()
    for index, (method, percentile) in enumerate(METHOD_CANDIDATES):
        if index == 1 and job.deadline is not None:
            minmax_seconds = time.monotonic() - began
            clock = StepClock(job.deadline, AFTER_CANDIDATES * minmax_seconds, minmax_seconds)
        if clock is not None and not clock.another():
            skipped.append(method if percentile is None else f"{method} {percentile:g}")
            continue
        candidate = replace(settings, method=method, percentile=percentile)
        step = (lambda done, _total, index=index: progress(index * len(rest) + done, len(METHOD_CANDIDATES) * len(rest))) if progress else None
        try:
            quantized = calibrated_model(job, rest, candidate, overrides, step, histograms)
        except PtqError:
            if index == 0:
                raise  # MinMax itself: the model cannot be calibrated, said in onnxruntime's words
            scores.append((method, percentile, None))
            continue
        name = judged_in(quantized, judged)
        scores.append((method, percentile, sqnr_figure(image_sqnr_db(reference, tensor_outputs(quantized, name, job.input_name, held_out, threads)))))
    if skipped and job.deadline is not None:
        notes.append(f"method auto: {', '.join(skipped)} not judged (within {job.deadline.describe()}, learned rounding and writing the model "
                     "come first)")
    method, percentile = chosen_method(tuple(scores))
    return replace(settings, method=method, percentile=percentile).with_evidence(method_sqnr_db=tuple(scores)), notes


def judged_choices(job: Job, settings: QuantizationSettings, overrides: dict | None,
                   progress: ProgressCallback | None) -> tuple[QuantizationSettings, dict | None, list[str], int]:
    """`--method auto`, then a judged overflow fix, on held-out calibration images (not where the graph is tied to a
    fixed batch): (settings, the overrides of the fix kept, notes, images shown on the progress bar)."""
    fixed_batch = job.fixed_batch
    notes: list[str] = []
    done = 0  # images already shown on the progress bar, before this phase
    if settings.method == AUTO_METHOD:
        if fixed_batch is not None:
            settings = replace(settings, method=METHOD_CANDIDATES[0][0])
            notes.append(f"method auto: {METHOD_CANDIDATES[0][0]} (the graph is tied to its fixed batch of {fixed_batch})")
        else:
            settings, chosen = choose_method(job, settings, overrides, progress)
            notes += chosen
            done = len(METHOD_CANDIDATES) * len(judged_images(job).calibrating_index)
    if settings.overflow_fix == overflow.JUDGED:
        settings, overrides, judged = _judge_overflow_fix(job, settings, overrides)
        notes += judged
    return settings, overrides, notes, done


def _judge_overflow_fix(job: Job, settings: QuantizationSettings, all_layers: dict | None) -> tuple[QuantizationSettings, dict | None, list[str]]:
    """all-layers (proven: the model cannot saturate) against first-layer (measured: it can elsewhere), each
    calibrated with the method kept on 3/4 of the calibration images and judged, nearest-rounded, by the image SQNR on
    the other 1/4; first-layer on both x86 paths where this machine runs the saturating one at native speed, by the
    worse; all-layers kept unless first-layer is METHOD_MARGIN_DB closer. (settings, its overrides, notes)."""
    import onnx

    from ptq_cli.metrics import image_sqnr_db

    float_model = onnx.load(job.source)
    first_layer = fix_overrides(float_model, replace(settings, overflow_fix=overflow.FIRST_LAYER), job.float_nodes)
    split = judged_images(job)  # those `--method auto`'s candidates were calibrated on: its MinMax figure is all-layers'
    held_out, rest = split.held_out, split.calibrating
    if job.fixed_batch is not None or len(held_out) == 0 or len(rest) == 0:
        return replace(settings, overflow_fix=overflow.FIRST_LAYER), first_layer, [f"overflow fix: {overflow.FIRST_LAYER} (not judged: too few "
                                                                                 "calibration images, or a graph tied to its fixed batch)"]
    threads = resolve_threads(None)
    judged = judged_output(float_model)
    reference = float_outputs(float_model, judged, job.input_name, held_out, threads)

    def score(overrides: dict | None) -> tuple[float | None, Any]:
        quantized = calibrated_model(job, rest, settings, overrides)
        return sqnr_figure(image_sqnr_db(reference, tensor_outputs(quantized, judged_in(quantized, judged), job.input_name, held_out, threads))), quantized

    kept_method = [db for method, percentile, db in settings.evidence.method_sqnr_db if (method, percentile) == (settings.method, settings.percentile)]
    all_db = kept_method[0] if kept_method else score(all_layers)[0]
    first_db, first_model = score(first_layer)
    saturating, notes = _saturating_figure(job, first_model, judged_in(first_model, judged), held_out, reference)
    figures = ((overflow.ALL_LAYERS, all_db), (overflow.FIRST_LAYER, first_db), *saturating)
    worst_first = min((db for _, db in figures[1:]), key=lambda db: np.inf if db is None else db) if first_db is not None else None
    keep_first = closer_by_margin(worst_first, all_db)
    settings = replace(settings, overflow_fix=overflow.FIRST_LAYER if keep_first else overflow.ALL_LAYERS).with_evidence(overflow_fix_db=figures)
    return settings, first_layer if keep_first else all_layers, notes  # the figures: the CPUs' description (quant_settings.describe_cpus)


SATURATING_FIRST_LAYER = f"{overflow.FIRST_LAYER} on the saturating path"


def _saturating_figure(job: Job, model, name: str, images: np.ndarray, reference: np.ndarray) -> tuple[tuple[tuple[str, float | None], ...], list[str]]:
    """The first-layer model's image SQNR on the saturating x86 path, as an overflow fix's figure ((), where it
    provably computes the same on both paths), and a note where this machine does not reach that path at native speed."""
    from ptq_cli.metrics import image_sqnr_db

    if overflow.saturation_proof(model)[0]:
        return (), []
    try:
        outputs = _saturating_outputs(job, model, name, images, resolve_threads(None))
    except PtqError as error:
        return (), [f"overflow fix: judged on the exact int8 path only (the saturating path could not be run: {first_line(error)})"]
    if outputs is None:
        return (), ["overflow fix: judged on the exact int8 path only (this machine does not run the saturating path natively for this "
                    "model; under emulation it is too slow for a judge)"]
    return ((SATURATING_FIRST_LAYER, sqnr_figure(image_sqnr_db(reference, outputs))),), []


def _saturating_outputs(job: Job, model, name: str, images: np.ndarray, threads: int) -> np.ndarray | None:
    """The tensor `name` on the saturating x86 int8 path: this CPU's own kernels where they saturate, else onnxruntime's
    AVX2 kernels where this machine runs them natively (the service's `job.saturating_scores`); None where neither can."""
    import onnx

    if not cpu_info.current().exact_int8:
        return tensor_outputs(model, name, job.input_name, images, threads, exact_kernels=False)
    cut = computing_only(model, name)
    if cut is None or job.saturating_scores is None:
        return None
    typed = copy.deepcopy(model.graph.output[0])  # for the loader's checker: the scores a final Softmax reads have its type
    typed.name = name
    del cut.graph.output[:]
    cut.graph.output.append(typed)
    path = job.workdir / "saturating-judge.onnx"
    onnx.save(cut, str(path))
    try:
        return job.saturating_scores(path, images, threads)
    finally:
        path.unlink(missing_ok=True)


def calibrated_model(job: Job, images: np.ndarray, settings: QuantizationSettings, overrides: dict | None,  # noqa: PLR0913  the bar and the shared histograms
                     progress: ProgressCallback | None = None, histograms: dict | None = None):
    """The model quantize_static makes with these settings' ranges, calibrated on `images`, with ptq's edits (`job.finish`),
    nearest-rounded: a candidate `--method auto` judges."""
    import onnx

    target = job.workdir / "candidate.onnx"
    write_qdq(job, target, images, settings, overrides, progress, histograms, fixed_batch=None)
    quantized = onnx.load(str(target))
    job.finish(quantized)
    target.unlink()
    return quantized


class PartScores:
    """`ranges.search`'s score: the output's image SQNR (metrics.image_sqnr_db) against `reference` on `images`, from
    a run of only the part of the model that depends on the moved scale (transforms/graph.py, part_after), fed the tensors the rest of the model
    computes, once a scale (they do not depend on it). The whole model where there is no such part, or its tensors would
    take more than SEARCH_FED_BYTES. The part's scores differ from the whole model's by float rounding alone (a
    convolution onnxruntime runs in float in one and on integers in the other); what the search keeps is measured on
    the whole model."""

    def __init__(self, output: str, input_name: str, images: np.ndarray, threads: int, chunk: int, reference: np.ndarray) -> None:
        self._output, self._input_name, self._images, self._threads, self._chunk = output, input_name, images, threads, chunk
        self._reference = reference
        self._fed_for: str | None = None
        self._fed: dict[str, np.ndarray] | None = None

    def __call__(self, model, moved: str | None) -> float:
        from ptq_cli.metrics import image_sqnr_db

        part = None if moved is None else part_after(model, moved, self._output)
        if part is not None and moved != self._fed_for:
            self._fed, self._fed_for = self._feeds(model, part[1]), moved
        if part is not None and self._fed is not None:
            try:
                session, fed = probe_session(part[0], self._threads), self._fed
                scores = [session.run([self._output], {name: values[start : start + self._chunk] for name, values in fed.items()})[0]
                          for start in range(0, len(self._images), self._chunk)]
                return image_sqnr_db(self._reference, np.concatenate(scores))
            except Exception:  # noqa: BLE001  onnxruntime's own errors on the part alone: this scale's candidates run whole
                self._fed = None
        return image_sqnr_db(self._reference, tensor_outputs(model, self._output, self._input_name, self._images, self._threads, self._chunk))

    def _feeds(self, model, reads: list[str]) -> dict[str, np.ndarray] | None:
        """The tensors the part reads, over all the images; None past SEARCH_FED_BYTES or where the rest cannot be cut out."""
        made = [name for name in reads if name != self._input_name]
        fed = {self._input_name: self._images} if self._input_name in reads else {}
        if not made:
            return fed
        before = computing_only(model, *made)
        parts = None if before is None else chunked_run(before, made, self._input_name, self._images, self._threads, self._chunk, SEARCH_FED_BYTES)
        if parts is None:
            return None
        return fed | {name: np.concatenate([part[index] for part in parts]) for index, name in enumerate(made)}


def search_ranges(quantized, float_path: str, calibration: np.ndarray, input_name: str, settings: QuantizationSettings,
                  progress: ProgressCallback | None = None) -> tuple[Any, QuantizationSettings, list[str]]:
    """(model, settings with `ranges` decided, notes): every activation scale searched (quantize/ranges.py) on
    the images learned rounding reads, kept where that brings the output closer to FP32 on held-out calibration
    images by METHOD_MARGIN_DB."""
    import onnx

    from ptq_cli.metrics import image_sqnr_db

    held_out, rest = held_out_split(calibration)
    if len(held_out) == 0 or len(rest) == 0:
        return quantized, settings, []
    pixels = image_pixels(calibration)
    searching = rest[even_draw(len(rest), rounding_image_count(pixels))]
    runs, needed = max(1, RANGE_SEARCH_PIXELS // (pixels * len(searching))), len(ranges.activation_scales(quantized)) * len(ranges.FACTORS) + 1
    if needed > runs:  # a sweep cut short would search the first layers only: none at all, and said
        return quantized, settings, [f"range search: not run (one sweep over its activation scales takes {needed} runs of {len(searching)} "
                                     f"calibration images, over the budget of {runs})"]
    threads = resolve_threads(None)
    float_model = onnx.load(float_path)
    judged = judged_output(float_model)
    name = judged_in(quantized, judged)
    reference, held_reference = (float_outputs(float_model, judged, input_name, images, threads) for images in (searching, held_out))
    calibrated = onnx.ModelProto.FromString(quantized.SerializeToString())
    try:
        chunk = max(16, SEARCH_CHUNK_PIXELS // pixels)  # small images in few runs: the search calls the model hundreds of times
        searched, result = ranges.search(quantized, PartScores(name, input_name, searching, threads, chunk, reference), runs, progress)
    except Exception as error:  # noqa: BLE001  onnxruntime's own errors: the user keeps the calibrated ranges
        return calibrated, settings, [f"range search: not applied ({first_line(error)})"]
    before, after = (image_sqnr_db(held_reference, tensor_outputs(model, name, input_name, held_out, threads)) for model in (calibrated, searched))
    choice = "searched" if closer_by_margin(after, before) else "calibrated"
    measured = replace(settings, ranges=choice).with_evidence(ranges_calibrated_db=sqnr_figure(before), ranges_searched_db=sqnr_figure(after))
    note = (f"range search: {result.moved} of {result.scales} activation scales moved ({result.searched} searched, {result.evaluations} runs "
            f"of {len(searching)} calibration images); image SQNR on {len(held_out)} held-out images {before:.2f} dB calibrated, "
            f"{after:.2f} dB searched; kept {choice}")
    return (searched if choice == "searched" else calibrated), measured, [note]


def refined(job: Job, quantized, settings: QuantizationSettings, search: bool, progress: ProgressCallback | None,  # noqa: PLR0913  the MinMax model, where it may be rounded too
            minmax_model: Callable[..., Any] | None = None) -> tuple[Any, QuantizationSettings, list[str]]:
    """The quantized model after ptq's refinements on the calibration images: learned rounding, then the activation
    ranges searched (`search`: `--method auto`); each kept where it measures closer to FP32 on held-out images.
    `minmax_model(settings=...)`, where `--method auto` kept a percentile: the model calibrated with MinMax instead, to be rounded too."""
    notes: list[str] = []
    source, calibration, input_name, fixed_batch = job.source, job.calibration, job.input_name, job.fixed_batch
    if fixed_batch is not None:
        if settings.rounding != NEAREST:
            settings, notes = replace(settings, rounding=NEAREST), [f"learned rounding: not applied (the graph is tied to its fixed batch of {fixed_batch})"]
        return quantized, settings, notes
    done, deadline = 0, job.deadline
    if settings.rounding != NEAREST:
        asked = settings
        quantized, settings, notes = refine_rounding(quantized, source, calibration, input_name, settings, progress, deadline)
        done = len(rounding.find_layers(quantized))
        if minmax_model is not None and _kept_rounding_db(settings) is not None:
            if deadline is not None and not deadline.fits(0.0, AFTER_ROUNDING_SHARE * deadline.seconds):
                notes.append(f"method auto: {settings.method} {settings.percentile:g} kept without MinMax rounded again to compare "
                             f"({deadline.describe()} was spent)")
            else:
                minmax = replace(asked, method=METHOD_CANDIDATES[0][0], percentile=None)
                rounded = refine_rounding(minmax_model(settings=minmax), source, calibration, input_name, minmax, progress_after(progress, done), deadline)
                quantized, settings, notes = _rounded_method((quantized, settings, notes), rounded)
                done *= 2
    if search and deadline is not None and deadline.left() <= 0:
        notes.append(f"range search: not run ({deadline.describe()} was spent)")
    elif search:  # after the rounding: what the weights no longer cost, the ranges can still win back
        quantized, settings, searched_notes = search_ranges(quantized, source, calibration, input_name, settings, progress_after(progress, done))
        notes += searched_notes
    return quantized, settings, notes


def _kept_rounding_db(settings: QuantizationSettings) -> float | None:
    """The held-out SQNR of the rounding `refine_rounding` kept, where it compared the two."""
    return settings.evidence.rounding_learned_db if settings.rounding == LEARNED else settings.evidence.rounding_nearest_db


def _rounded_method(percentile: tuple[Any, QuantizationSettings, list[str]], minmax: tuple[Any, QuantizationSettings, list[str]]
                    ) -> tuple[Any, QuantizationSettings, list[str]]:
    """Of the percentile `--method auto` kept on nearest-rounded models and MinMax, both after learned rounding: the
    percentile where it still measures better by METHOD_MARGIN_DB on the held-out images, else MinMax. Nearest rounding's
    error can hide what a clipped range costs once the weights are rounded well."""
    (_, chosen, _), (_, other, _) = percentile, minmax
    chosen_db, other_db = _kept_rounding_db(chosen), _kept_rounding_db(other)
    kept = percentile if other_db is None or (chosen_db is not None and chosen_db >= other_db + METHOD_MARGIN_DB) else minmax
    measured = ((chosen.method, chosen.percentile, chosen_db), (other.method, None, other_db))
    model, settings, notes = kept

    def label(made: QuantizationSettings) -> str:
        return f"{made.method} {made.percentile:g}" if made.percentile is not None else made.method

    def figure(db: float | None) -> str:
        return "-" if db is None else f"{db:.2f}"

    note = (f"method auto: after weight rounding, image SQNR on held-out calibration images {label(chosen)} {figure(chosen_db)} dB, "
            f"{label(other)} {figure(other_db)} dB; kept {label(kept[1])}")
    return model, settings.with_evidence(method_sqnr_db=chosen.evidence.method_sqnr_db, method_rounded_db=measured), [*notes, note]


def fix_overrides(graph, settings: QuantizationSettings, float_nodes: list[str]) -> dict | None:
    """The weight scales of the settings' overflow fix (all-layers while it is judged), as TensorQuantOverrides."""
    fix = overflow.ALL_LAYERS if settings.overflow_fix == overflow.JUDGED else settings.overflow_fix
    if fix in overflow.OVERFLOW_FIXES and settings.weight_dtype == "int8":
        return overflow.weight_overrides(graph, fix, bool(settings.per_channel), set(float_nodes))
    return None


