"""z3 leaf modules (DeepSpeed's names): a module gathered as one stage-3 unit, no hooks inside.

Useful for a module whose submodules do not all run in every forward (a mixture of
experts): as one unit, all its parameters are gathered before it runs, whichever
submodules it calls. Set before ``initialize`` (units are chosen there).
"""

from __future__ import annotations

from torch import nn


def _matches(m: nn.Module, classes: list[type | str]) -> bool:
    cls = type(m)
    return any((isinstance(c, type) and isinstance(m, c))
               or (isinstance(c, str) and c in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"))
               for c in classes)


def _set(model: nn.Module, classes: list[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf module classes must be types or class names, got {classes!r}")
    found = [m for m in model.modules() if _matches(m, classes)]
    if not found and raise_if_not_found:
        raise ValueError(f"no module of type {classes!r} in {type(model).__name__}")
    for m in found:
        m._z3_leaf = flag
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of these classes (types, class names or qualified names) as a leaf."""
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    return _set(model, leaf_module_classes, False, raise_if_not_found)


def z3_leaf_module(model: nn.Module) -> bool:
    return bool(getattr(model, "_z3_leaf", False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def _set_where(model: nn.Module, keys: list[str], hit, flag: bool, raise_if_not_found: bool,
               what: str) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose ``named_modules()`` name satisfies ``hit(name, key)`` for some key."""
    named = list(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for key in keys:
        matched = [m for n, m in named if hit(n, key)]
        if not matched:
            missing.append(key)
        for m in matched:
            m._z3_leaf = flag
            found.setdefault(id(m), m)
    if missing and raise_if_not_found:
        raise ValueError(f"no module {what} {missing!r} in {type(model).__name__}")
    return list(found.values()), missing


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag (or with ``flag=False`` unflag) the modules of these ``named_modules()`` names;
    returns (the modules, the names that matched none)."""
    return _set_where(model, module_names, lambda n, k: n == k, flag, raise_if_not_found, "named")


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """As :func:`set_z3_leaf_modules_by_name` for every module whose name ends with a suffix."""
    return _set_where(model, module_name_suffixes, lambda n, k: n.endswith(k), flag, raise_if_not_found,
                      "with name suffix")
