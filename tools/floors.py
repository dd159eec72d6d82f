"""The floors of the code, read off its import lines: which package imports which, and what each
module is for (its docstring's first sentence). tests/unit/test_floors.py checks the rule; the
architecture page shows the picture and the module map generated here (tools/docgen.py), so
neither can drift from the code.

    msd                                          the `msd` command; what composes several roles
    coordinator   worker   relay   trainer_client the roles: none imports another, nor msd
    msd_common                                   the floor they share
"""

from __future__ import annotations

import ast
import html
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("msd_common", "coordinator", "worker", "relay", "trainer_client", "msd")
ROLES = ("coordinator", "worker", "relay", "trainer_client")
ALLOWED = {  # what each package may import of the others
    "msd_common": set(),
    "coordinator": {"msd_common"},
    "worker": {"msd_common"},
    "relay": {"msd_common"},
    "trainer_client": {"msd_common"},
    "msd": {"msd_common", "coordinator", "worker", "relay", "trainer_client"},
}
ROLE = {"msd_common": "the floor every role shares", "coordinator": "role: plans, one per job",
        "worker": "role: reads and makes samples", "relay": "role: one per trainer host",
        "trainer_client": "role: in each trainer rank",
        "msd": "the msd command: composes roles"}


def imports_of(path: str, package: str) -> set[str]:
    """The packages of ours a module imports (absolute or relative, at any depth of the module)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                out.add(node.module.split(".")[0])
            elif node.level:  # relative: it stays in its own package
                out.add(package)
    return out & set(PACKAGES)


def modules(root: str = ROOT) -> list[tuple[str, str]]:
    """(package, path) of every module of ours."""
    found = []
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found += [(package, os.path.join(folder, f)) for f in sorted(files) if f.endswith(".py")]
    return found


def package_graph(root: str = ROOT) -> dict[str, set[str]]:
    """package -> the other packages of ours its modules import."""
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for package, path in modules(root):
        graph[package] |= imports_of(path, package) - {package}
    return graph


def wrong_imports(root: str = ROOT) -> dict[str, list[str]]:
    """module path -> the packages it imports against the floors."""
    out = {}
    for package, path in modules(root):
        wrong = sorted(imports_of(path, package) - ALLOWED[package] - {package})
        if wrong:
            out[os.path.relpath(path, root)] = wrong
    return out


def summary(path: str) -> str:
    """A module's docstring, first sentence (or its first line)."""
    with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read(), path)) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".") if first else ""


def floors_svg(graph: dict[str, set[str]]) -> str:
    """The packages as boxes on their floors, an arrow for each package import found in the code."""
    pos = {"msd": (400, 20), "coordinator": (20, 130), "worker": (270, 130), "relay": (520, 130),
           "trainer_client": (770, 130), "msd_common": (400, 240)}
    w, h = 210, 56
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 1000 316" width="100%" style="max-width: 1000px" '
             'font-family="Helvetica, Arial, sans-serif" font-size="13">',
             '<defs><marker id="f" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
             '<rect width="1000" height="316" fill="#fff"/>']
    for src in PACKAGES:
        for dst in sorted(graph[src]):
            (x1, y1), (x2, y2) = pos[src], pos[dst]
            a = (x1 + w / 2, y1 + h if y2 > y1 else y1)
            b = (x2 + w / 2, y2 if y2 > y1 else y2 + h)
            if src == "msd" and dst == "msd_common":  # around the middle box
                a, b = (x1 + w, y1 + h / 2), (x2 + w, y2 + h / 2)
                parts.append(f'<path d="M{a[0]},{a[1]} C{a[0] + 170},{a[1]} {b[0] + 170},{b[1]} {b[0]},{b[1]}" '
                             'fill="none" stroke="#555" marker-end="url(#f)"/>')
                continue
            colour = "#555" if dst in ALLOWED[src] else "#d00"
            parts.append(f'<line x1="{a[0]}" y1="{a[1]}" x2="{b[0]}" y2="{b[1]}" stroke="{colour}" '
                         'marker-end="url(#f)"/>')
    for package, (x, y) in pos.items():
        fill = "#eef3fd" if package in ROLES else "#f4f4f4"
        parts.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" stroke="#3056c7"/>')
        parts.append(f'<text x="{x + w / 2}" y="{y + 23}" text-anchor="middle" font-weight="bold">{package}/</text>')
        parts.append(f'<text x="{x + w / 2}" y="{y + 42}" text-anchor="middle" fill="#444">'
                     f'{html.escape(ROLE[package])}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def floors_md(root: str = ROOT) -> str:
    """The picture and a table of every module by package, with what it is for."""
    graph = package_graph(root)
    out = [floors_svg(graph), "",
           "An arrow is an import found in the code (red: one against the floors; "
           "`tests/unit/test_floors.py` fails on it).", ""]
    for package in ("msd_common", *ROLES, "msd"):
        imports = ", ".join(f"`{p}`" for p in sorted(graph[package])) or "nothing of ours"
        out += [f"#### `{package}/`", "", f"{ROLE[package][0].upper()}{ROLE[package][1:]}; imports {imports}.", "",
                "| module | what it is for |", "|---|---|"]
        for p, path in modules(root):
            if p == package and not path.endswith("__init__.py"):
                text = summary(path)
                name = os.path.relpath(path, os.path.join(root, package))
                # (a module's name is not broken across lines: it is what a reader looks for)
                out.append(f'| <code style="white-space: nowrap">{name}</code> | {text.replace("|", "/")} |')
        out.append("")
    return "\n".join(out)
