"""Which transformers MoE models the "megamoe" experts backend can run: every experts class that
transformers dispatches through `ExpertsInterface` (`@use_experts_implementation`), built from
its model's default config shrunk to a few tiny experts, checked by the backend's own
`unsupported` (the check it runs on every call). No GPU, no download.

    python scripts/hf_experts_layouts.py
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transformers  # noqa: E402

from megamoe_bwd.integrations.transformers import unsupported  # noqa: E402

# Small sizes for whichever of these a config has (the check looks at the layout, not the sizes).
_SMALL = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=32, expert_intermediate_size=32,
              num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4)


def experts_classes():
    """(model, experts class, its module) of every experts class under `@use_experts_implementation`."""
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    for model in sorted(os.listdir(root)):
        path = os.path.join(root, model, f"modeling_{model}.py")
        if not os.path.exists(path):
            continue
        names = re.findall(r"@use_experts_implementation[^\n]*\nclass (\w+)\(", open(path).read())
        if names:
            module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
            for name in names:
                yield model, getattr(module, name)


def verdict(model: str, experts_class) -> str:
    configs = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
    for config_class in (v for k, v in vars(configs).items()
                         if k.endswith("Config") and inspect.isclass(v) and issubclass(v, transformers.PretrainedConfig)):
        try:
            config = config_class()
            config = getattr(config, "text_config", None) or config
            for key, value in _SMALL.items():
                if hasattr(config, key):
                    setattr(config, key, value)
            problems = unsupported(experts_class(config))
        except Exception:  # noqa: BLE001 (this config class does not build these experts; try the next)
            continue
        return "yes" if not problems else "no: " + "; ".join(problems)
    return "not checked (no default config builds it)"


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    warnings.filterwarnings("ignore")
    print(f"transformers {transformers.__version__}")
    for model, experts_class in experts_classes():
        print(f"{model:<18} {experts_class.__name__:<34} {verdict(model, experts_class)}")


if __name__ == "__main__":
    main()
