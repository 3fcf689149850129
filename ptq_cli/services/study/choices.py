"""`ptq quantize` as the command runs it: the model made (make/quantize.py), then the other models already made from
the same FP32 model, as their records measured them on this CPU (measure/report.py), so that the answer names the
alternatives the user has measured. make/ measures nothing of other models; the study composes the two."""

from __future__ import annotations

from dataclasses import replace

from ptq_cli.model_file import file_sha256
from ptq_cli.services.make.quantize import QuantizeRequest, QuantizeResult
from ptq_cli.services.make.quantize import run as make_quantized
from ptq_cli.services.measure.report import measured_from
from ptq_cli.services.progress import ProgressBar, no_progress_bar


def quantize(request: QuantizeRequest, progress_bar: ProgressBar = no_progress_bar) -> QuantizeResult:
    """make/quantize.run, its result naming what the records under the request's results folder measured of the other
    models made from the same FP32 model (the one just written left out: its record, if any, is stale)."""
    result = make_quantized(request, progress_bar)
    if request.results_dir is None:
        return result
    return replace(result, measured_choices=measured_from(request.results_dir, file_sha256(result.source), leaving_out=result.output))
