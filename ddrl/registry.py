"""The few registries of ddrl: the only string dispatch in the code.

A name that is not registered fails with the list of valid names, so a typo in a config is
caught before any compute. A user's own object is named by import path instead, "package.module:attr"
(`import_object`: tasks, rewards).
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown name was looked up; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None) -> Any:
        """Register obj under name; usable as a decorator: @REG.register("name")."""

        def add(o: T) -> T:
            if name in self._items and self._items[name] is not o:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = o
            return o

        return add(obj) if obj is not None else add

    def get(self, name: str) -> T:
        _ensure_builtins_loaded()
        if name not in self._items:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; valid {self.kind}s: {', '.join(sorted(self._items))}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        _ensure_builtins_loaded()
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        _ensure_builtins_loaded()
        return sorted(self._items.items())

    def __contains__(self, name: str) -> bool:
        _ensure_builtins_loaded()
        return name in self._items


def import_object(path: str, what: str) -> Any:
    """The object "package.module:attr" names (attr may be dotted: "module:Class.method").

    what: what the object is for, in the error's words ("task 'my_tasks:make'"). A module that cannot
    be imported and an attribute it lacks are a ValueError naming both, and the fix."""
    import importlib

    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what}: {path!r} is not an import path; write package.module:attr")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # the module (or its package) is missing, not something it imports: say where Python looks
        missing_itself = bool(e.name) and (module_name + ".").startswith(f"{e.name}.")
        hint = ("; the `ddrl` command imports from the working directory, Python from sys.path: put the folder "
                "that holds it on PYTHONPATH (PYTHONPATH=. for the current one)")
        raise ValueError(f"{what}: cannot import {module_name!r}: {e}{hint if missing_itself else ''}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


PROCESSES: Registry[Callable[..., Any]] = Registry("process")
SAMPLERS: Registry[Callable[..., Any]] = Registry("sampler")
ESTIMATORS: Registry[Callable[..., Any]] = Registry("estimator")
OBJECTIVES: Registry[type[Any]] = Registry("objective")  # dataclasses with the class attributes of objectives.base
TASKS: Registry[Callable[..., Any]] = Registry("task")

_loaded = False


def _ensure_builtins_loaded() -> None:
    """Import the built-in modules once so their @register decorators run."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib

    for module in ("ddrl.processes", "ddrl.sampling", "ddrl.estimators", "ddrl.objectives", "ddrl.tasks"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:  # a layer not built yet must not hide the others
            if e.name != module:
                raise
