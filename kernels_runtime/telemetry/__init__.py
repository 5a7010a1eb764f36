"""Per-rank telemetry: counters and samples of memory, communication and throughput, and the
last pipeline step's timeline.

The lowest layer of the runtime and free of torch: probes and publishing are injected, so
``torchrun`` scripts, pool engines and the notebook side (which imports ``TELEMETRY_KEY``) all
use it unchanged.
"""

from kernels_runtime.telemetry.expert_load import ExpertLoad
from kernels_runtime.telemetry.flops import model_shape, training_flops_per_token
from kernels_runtime.telemetry.publisher import Publisher
from kernels_runtime.telemetry.split import StepSplitter, StepTiming
from kernels_runtime.telemetry.telemetry import TELEMETRY_KEY, StepRecord, Telemetry, host_memory
from kernels_runtime.telemetry.timeline import compact_timeline

__all__ = ["TELEMETRY_KEY", "ExpertLoad", "Publisher", "StepRecord", "StepSplitter", "StepTiming",
           "Telemetry", "compact_timeline", "host_memory", "model_shape",
           "training_flops_per_token"]
