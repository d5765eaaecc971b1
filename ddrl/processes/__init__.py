"""Forward (noising) processes: masked, uniform and block diffusion, and their noise schedules.

Importing this package registers the processes in ddrl.registry.PROCESSES under the names
"masked", "uniform", "block" and "metric_path" (URSA's metric-induced path). ForwardProcess states the
interface every process implements, ScheduledProcess the schedule and NELBO of masked, block and
uniform diffusion (ddrl.processes.base).
"""

from ddrl.processes.base import ForwardProcess, ScheduledProcess
from ddrl.processes.block import (
    BlockMaskedProcess,
    blockwise_elbo,
    staircase_elbo,
    staircase_inputs,
    staircase_mask,
)
from ddrl.processes.draws import sample_categorical
from ddrl.processes.masked import MaskedProcess
from ddrl.processes.metric_path import MetricPathProcess
from ddrl.processes.schedules import CosineSchedule, LinearSchedule, Schedule, get_schedule
from ddrl.processes.uniform import ClassProcess, UniformProcess

__all__ = [
    "BlockMaskedProcess",
    "ClassProcess",
    "CosineSchedule",
    "ForwardProcess",
    "LinearSchedule",
    "MaskedProcess",
    "MetricPathProcess",
    "Schedule",
    "ScheduledProcess",
    "UniformProcess",
    "blockwise_elbo",
    "get_schedule",
    "sample_categorical",
    "staircase_elbo",
    "staircase_inputs",
    "staircase_mask",
]
