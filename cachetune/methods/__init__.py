"""Methods as plug-ins (see base.py for the contract). Importing this package registers every
method: one file per method or family of methods, each adding itself to `METHODS`."""

# Registration order is the order `method_names()` lists (and `--methods all` runs) them.
from cachetune.methods import full_recompute, ape, ranked, cacheblend, cacheslide, prophetkv, compressed, c2kv, kvlink, blockattn  # noqa: F401, I001
from cachetune.methods.base import (
    METHODS,
    Method,
    check_request_method,
    config_settings,
    MethodContext,
    is_method,
    make_method,
    method_names,
    method_settings,
    register,
)
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import Prefill
from cachetune.methods.selector import SelectionRequest, SelectiveMethod, TokenSelector, split_global_top

__all__ = ["METHODS", "Method", "MethodContext", "Prefill", "PromptLayout", "Segment", "SelectionRequest",
           "SelectiveMethod", "TokenSelector", "check_request_method", "config_settings", "is_method", "make_method", "method_names", "method_settings",
           "register", "split_global_top"]
