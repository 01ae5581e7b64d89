"""Methods as plug-ins (see base.py for the contract). Importing this package imports every module in
it, and each method module registers its methods in `METHODS` as it is imported: adding a method is
adding a module. A module's `ORDER` places its methods in `method_names()` (and `--methods all`)."""

import importlib
import pkgutil

from cachetune.methods.base import (
    METHODS,
    Method,
    MethodContext,
    check_request_method,
    config_settings,
    is_method,
    make_method,
    method_names,
    method_settings,
    register,
)
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector, split_global_top
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import Prefill


def _import_every_module() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_every_module()

__all__ = ["METHODS", "Method", "MethodContext", "Prefill", "PromptLayout", "Segment", "SelectionRequest",
           "SelectiveMethod", "TokenSelector", "check_request_method", "config_settings", "is_method", "make_method",
           "method_names", "method_settings", "register", "split_global_top"]
