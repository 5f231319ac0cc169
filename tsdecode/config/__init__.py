"""Config selection: the config space, the residency model, the heuristic, the tuned tables."""

from .heuristic import heuristic_config
from .select import SelectedConfig, select_config
from .space import KernelConfig, ProblemShape, fit_config

__all__ = ["KernelConfig", "ProblemShape", "SelectedConfig", "fit_config", "heuristic_config", "select_config"]
