"""How far each optional feature reaches into the rest of the code (issue 68: features as plug-ins of one
step pipeline): the production modules (`procs/ kernels/ shared/`) whose identifiers (AST names: variables,
attributes, functions, classes, arguments, keywords, imports; not comments or strings) name the feature.

The issue's goal is at most 4 such modules per feature outside the feature's own package (its registration,
the config, the messages struct, the C-kernel bridge). Until the features move into their packages this
test is a ratchet: each count may shrink, never grow, so a change that spreads a feature further fails here
and says where. Lower a ceiling when a move shrinks its count."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = ("procs", "kernels", "shared")

# feature -> (the identifiers that name it, the most production modules outside its own packages that may
# use them today)
FEATURES: dict[str, tuple[re.Pattern[str], int]] = {
    "lora": (re.compile(r"lora|adapter", re.I), 37),  # (+2: its CUDA kernels, kernels/triton/lora*.py)
    "speculation": (re.compile(r"draft|specul|ngram|proposer|spec_", re.I), 33),
    "pooling": (re.compile(r"pooling|pooler|pooled|rerank", re.I), 27),
    "structured output": (re.compile(r"grammar|bitmask|constraint", re.I), 17),
    "recurrent state": (re.compile(r"recurrent|conv_state|ssm_state|linear_attention|gated_delta", re.I), 15),
    "windows": (re.compile(r"window|sliding|ring_", re.I), 37),
}
# feature -> its own packages (one per process that has moved there), whose modules are not counted
PACKAGES: dict[str, tuple[str, ...]] = {
    "lora": ("procs/worker/lora/", "procs/scheduler/lora/"),
    "speculation": ("procs/worker/speculation/", "procs/scheduler/speculation/"),
    "pooling": ("procs/worker/pooling/",),
    "structured output": (),
    "recurrent state": ("procs/worker/recurrent/",),
    "windows": (),
}
# where the features are registered, in the worker and in the scheduler (each may name them all)
REGISTRATION = ("procs/worker/features.py", "procs/scheduler/features.py")


def identifiers(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg
        elif isinstance(node, ast.alias):
            yield (node.asname or node.name).rsplit(".", 1)[-1]


NAMES: dict[str, frozenset[str]] = {
    str(path.relative_to(ROOT)): frozenset(identifiers(ast.parse(path.read_text())))
    for top in PRODUCTION
    for path in sorted((ROOT / top).rglob("*.py"))
}


def modules_naming(pattern: re.Pattern[str]) -> list[str]:
    return [module for module, names in NAMES.items() if any(pattern.search(name) for name in names)]


def outside(feature: str) -> list[str]:
    """The production modules naming `feature`, outside its own packages and the registration."""
    own = PACKAGES[feature] + REGISTRATION
    return [module for module in modules_naming(FEATURES[feature][0]) if not module.startswith(own)]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_feature_reaches_no_further_than_it_does_today(feature: str) -> None:
    modules = outside(feature)
    ceiling = FEATURES[feature][1]
    assert len(modules) <= ceiling, (
        f"{feature} is named in {len(modules)} production modules (ceiling {ceiling}): keep it in its own "
        f"modules (issue 68). They are: {', '.join(modules)}"
    )


def test_the_identifiers_are_found() -> None:
    """The patterns match what the code calls the features (a renamed feature would pass the ratchet empty)."""
    assert "procs/worker/lora/slots.py" in modules_naming(FEATURES["lora"][0])
    assert "procs/worker/speculation/step.py" in modules_naming(FEATURES["speculation"][0])
    assert "procs/scheduler/speculation/ngram.py" in modules_naming(FEATURES["speculation"][0])
    assert "procs/worker/pooling/pooler.py" in modules_naming(FEATURES["pooling"][0])
    assert "procs/worker/grammar_masks.py" in modules_naming(FEATURES["structured output"][0])
    assert "kernels/recurrent_state.py" in modules_naming(FEATURES["recurrent state"][0])
    assert "kernels/kv_cache.py" in modules_naming(FEATURES["windows"][0])
