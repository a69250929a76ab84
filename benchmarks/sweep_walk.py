"""The walk count: how often following one sweep's data from ``run_sweep`` goes back into a file
of ``cluster/`` it had already left (issue 26). A static call-sequence walk, no Ray, no model:

1. every ``cluster/**.py`` is parsed; functions, classes and methods are indexed, and each module's
   import bindings (top-level and function-local) are read;
2. the walk starts in ``run_sweep`` and reads each function's body in source order, entering a
   callee at its first call (arguments before the call): a function or class of the same module,
   an imported name, ``module.function``, ``self.method``, ``x.method(...)`` when exactly one
   class in ``cluster/`` defines that method and the caller's module imports that class's module
   (common library names such as ``get`` or ``close`` excepted), ``actor.method.remote(...)`` as
   ``method``, and a class's ``__init__`` (a class
   without one, e.g. a dataclass, holds no code to read). A nested function or a bound method is
   read where it is called, or where it is handed to another function (a callback). Every function is read once;
   calls leaving ``cluster/`` (``sparsespec``, ``evals``, libraries) are not followed;
3. the files of the functions, in the order they are first read, with repeats in a row merged,
   are the walk; its count is the number of steps into a file that is already in the walk.

``--by-class`` reads a class whole (every method, in source order) when the walk first calls
one of its methods, as a reader would a short class: fewer, coarser steps.

    python benchmarks/sweep_walk.py                  # this checkout: the count, and the walk
    python benchmarks/sweep_walk.py --root /tmp/old  # another checkout (e.g. `git archive` of a commit)

``tests/test_layering.py`` keeps the count of this checkout bounded.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: where ``run_sweep`` lives, newest layout first
STARTS = ("cluster.sweep.run:run_sweep", "cluster.sweep:run_sweep")
#: method names too common (dicts, files, threads, progress bars, Ray) to resolve by name alone
COMMON = {"get", "put", "close", "update", "write", "append", "extend", "items", "keys", "values", "pop", "add",
          "remove", "copy", "run", "start", "join", "wait", "set", "clear", "read", "format", "replace", "split",
          "strip", "encode", "decode", "send", "main", "remote", "options", "setdefault", "sort", "index", "count"}


@dataclass
class Func:
    qualname: str  # module:Class.name or module:name
    module: str
    node: ast.AST
    cls: str | None = None
    nested: dict[str, "Func"] = field(default_factory=dict)
    bindings: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # its own imports


@dataclass
class Module:
    name: str
    path: Path
    funcs: dict[str, Func] = field(default_factory=dict)  # top-level functions
    classes: dict[str, dict[str, Func]] = field(default_factory=dict)  # class -> method -> Func
    bindings: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # top-level imports


def _module_name(root: Path, path: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _bindings(module: str, is_pkg: bool, nodes) -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute or None) for the import statements among ``nodes``."""
    out: dict[str, tuple[str, str | None]] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_pkg else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                out[a.asname or a.name] = (base, a.name)
    return out


def _nested(fn: Func, is_pkg: bool) -> None:
    fn.bindings = _bindings(fn.module, is_pkg, ast.walk(fn.node))
    for node in ast.walk(fn.node):
        if node is not fn.node and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sub = fn.nested.setdefault(node.name, Func(f"{fn.qualname}.{node.name}", fn.module, node, fn.cls))
            sub.bindings = fn.bindings


def load(root: Path) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for path in sorted((root / "cluster").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        name = _module_name(root, path)
        m = mods[name] = Module(name, path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                m.funcs[node.name] = Func(f"{name}:{node.name}", name, node)
            elif isinstance(node, ast.ClassDef):
                m.classes[node.name] = {
                    b.name: Func(f"{name}:{node.name}.{b.name}", name, b, node.name)
                    for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))}
        is_pkg = path.name == "__init__.py"
        for f in [*m.funcs.values(), *(f for c in m.classes.values() for f in c.values())]:
            _nested(f, is_pkg)
        top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        m.bindings = _bindings(name, is_pkg, [x for n in top for x in ast.walk(n)])
    return mods


class Walker:
    def __init__(self, mods: dict[str, Module], by_class: bool = False) -> None:
        self.mods, self.by_class = mods, by_class
        self.classes_read: set[tuple[str, str]] = set()
        self.read: set[str] = set()
        self.steps: list[tuple[str, str]] = []  # (file, function) in the order first read
        by_method: dict[str, list[Func]] = {}
        for m in mods.values():
            for methods in m.classes.values():
                for n, f in methods.items():
                    by_method.setdefault(n, []).append(f)
        self.unique_methods = {n: fs[0] for n, fs in by_method.items()
                               if len(fs) == 1 and not n.startswith("__") and n not in COMMON}
        #: the project modules each module imports (a method is resolved by name only into these)
        self.imports = {name: {name} | {self._module_key(src, attr) for src, attr in self._all_bindings(m)}
                        for name, m in mods.items()}

    @staticmethod
    def _all_bindings(m: Module):
        yield from m.bindings.values()
        for f in [*m.funcs.values(), *(f for c in m.classes.values() for f in c.values())]:
            yield from f.bindings.values()

    def _module_key(self, src: str, attr: str | None) -> str:
        return f"{src}.{attr}" if attr is not None and f"{src}.{attr}" in self.mods else src

    # ---------------------------------------------------------------- resolution
    def _class_entry(self, mod: str, cls: str) -> Func | None:
        methods = self.mods[mod].classes[cls]
        return methods.get("__init__") or methods.get("__post_init__")

    def _attr_of_module(self, mod: str, attr: str) -> Func | None:
        m = self.mods.get(mod)
        if m is None:
            return None
        if attr in m.funcs:
            return m.funcs[attr]
        if attr in m.classes:
            return self._class_entry(mod, attr)
        if attr in m.bindings:  # re-exported name (``from x import f`` at the top of mod)
            src, name = m.bindings[attr]
            if name is not None and src != mod:
                return self._attr_of_module(src, name)
        return None

    def _name(self, fn: Func, name: str) -> Func | None:
        if name in fn.nested:
            return fn.nested[name]
        m = self.mods[fn.module]
        if name in m.funcs:
            return m.funcs[name]
        if name in m.classes:
            return self._class_entry(fn.module, name)
        b = fn.bindings.get(name) or m.bindings.get(name)
        if b is not None and b[1] is not None:
            return self._attr_of_module(*b)
        return None

    def _module_of(self, fn: Func, name: str) -> str | None:
        b = fn.bindings.get(name) or self.mods[fn.module].bindings.get(name)
        if b is None:
            return None
        src, attr = b
        full = src if attr is None else f"{src}.{attr}"
        return full if full in self.mods else None

    def resolve(self, fn: Func, func: ast.AST) -> Func | None:
        if isinstance(func, ast.Name):
            return self._name(fn, func.id)
        if not isinstance(func, ast.Attribute):
            return None
        if func.attr == "remote" and isinstance(func.value, ast.Attribute):
            func = func.value  # actor.method.remote(...) runs actor.method
        if isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner == "self" and fn.cls is not None:
                return self.mods[fn.module].classes[fn.cls].get(func.attr)
            if owner in fn.bindings or owner in self.mods[fn.module].bindings:  # imported: never by method name
                mod = self._module_of(fn, owner)
                return self._attr_of_module(mod, func.attr) if mod is not None else None
        if isinstance(func.value, ast.Name) and self._foreign_local(fn, func.value.id):
            return None
        target = self.unique_methods.get(func.attr)
        if target is not None and target.module in self.imports[fn.module]:
            return target
        return None

    def _foreign_local(self, fn: Func, name: str) -> bool:
        """``name`` is a local of ``fn`` whose every assignment is a call of a builtin or of a
        library outside ``cluster/`` (``plan = getattr(model, "kernel_plan")``, ``t = torch.zeros(..)``):
        its methods are that library's, never resolved by method name into ``cluster/``."""
        values = [n.value for n in ast.walk(fn.node) if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
        return bool(values) and all(isinstance(v, ast.Call) and self._library_callable(fn, v.func) for v in values)

    def _library_callable(self, fn: Func, func: ast.AST) -> bool:
        root = func.value if isinstance(func, ast.Attribute) else func  # f(...) or module.f(...)
        if not isinstance(root, ast.Name):
            return False
        b = fn.bindings.get(root.id) or self.mods[fn.module].bindings.get(root.id)
        if b is not None:  # imported: a library's when its module is not ours
            return not b[0].startswith("cluster")
        return (isinstance(func, ast.Name) and hasattr(builtins, root.id)
                and root.id not in self.mods[fn.module].funcs and root.id not in self.mods[fn.module].classes)

    # ---------------------------------------------------------------- the walk
    def enter(self, fn: Func) -> None:
        if self.by_class and fn.cls is not None and (fn.module, fn.cls) not in self.classes_read:
            self.classes_read.add((fn.module, fn.cls))
            for method in self.mods[fn.module].classes[fn.cls].values():
                self.enter(method)
            return
        if fn.qualname in self.read:
            return
        self.read.add(fn.qualname)
        self.steps.append((str(self.mods[fn.module].path), fn.qualname))
        body = fn.node.body if hasattr(fn.node, "body") else []
        for stmt in body:
            self.visit(fn, stmt)

    def visit(self, fn: Func, node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return  # read when called (or handed over)
        if isinstance(node, ast.Call):
            self.visit(fn, node.func.value if isinstance(node.func, ast.Attribute) else node.func)
            for a in [*node.args, *(k.value for k in node.keywords)]:
                self.visit(fn, a)
                if isinstance(a, ast.Attribute):  # a bound method handed to another (a callback)
                    handed = self.resolve(fn, a)
                    if handed is not None:
                        self.enter(handed)
            target = self.resolve(fn, node.func)
            if target is not None:
                self.enter(target)
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in fn.nested:
            self.enter(fn.nested[node.id])  # a nested function handed to another (a callback)
            return
        for child in ast.iter_child_nodes(node):
            self.visit(fn, child)


def walk(root: Path = ROOT, start: str | None = None, by_class: bool = False) -> tuple[int, list[tuple[str, str]]]:
    """The walk count and the walk: (file, first function read there) per step."""
    mods = load(root)
    for s in ([start] if start else STARTS):
        mod, _, name = s.partition(":")
        if mod in mods and name in mods[mod].funcs:
            w = Walker(mods, by_class)
            w.enter(mods[mod].funcs[name])
            break
    else:
        raise SystemExit(f"no run_sweep found under {root} (tried {start or STARTS})")
    files: list[tuple[str, str]] = []
    for path, qual in w.steps:
        rel = str(Path(path).relative_to(root))
        if not files or files[-1][0] != rel:
            files.append((rel, qual))
    seen: set[str] = set()
    back = 0
    for rel, _ in files:
        back += rel in seen
        seen.add(rel)
    return back, files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    p.add_argument("--start", default=None, help="module:function to start from (default: run_sweep)")
    p.add_argument("--by-class", action="store_true", help="read a class whole at the first call of a method")
    p.add_argument("--quiet", action="store_true", help="print the count only")
    a = p.parse_args(argv)
    back, files = walk(a.root.resolve(), a.start, a.by_class)
    if not a.quiet:
        seen: set[str] = set()
        for i, (rel, qual) in enumerate(files, 1):
            mark = "back" if rel in seen else "    "
            seen.add(rel)
            print(f"{i:3d} {mark} {rel:40s} {qual}")
    print(f"walk count (steps back into a file already left): {back}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
