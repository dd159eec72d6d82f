"""The user's code a job names, checked where the job is checked: a transform (imported, its code
hashed: part of the job's identity) and a chat template (found beside the tokenizer, compiled in
the sandboxed environment transformers renders it in).

The spec layer (msd_common/spec.py) calls these when it parses a job; the workers call the same
functions when they run the code, so that what was checked is what runs.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import sys
from contextvars import ContextVar
from datetime import datetime
from typing import Any, Callable

import orjson

TRAIN_ON = ("assistant", "all", "last")
TEMPLATE_FILE = "chat_template.jinja"


class TransformImportError(ValueError):
    """A transform that cannot be imported: names the module and the exception."""


def load(spec: str) -> Callable[..., Any]:
    """Import `package.module:function` (from the worker's own Python environment)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TransformImportError(f"transform {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # whatever the module raises on import
        raise TransformImportError(f"transform {spec!r}: cannot import module {module_name!r} "
                                   f"({type(e).__name__}: {e})") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise TransformImportError(f"transform {spec!r}: module {module_name!r} has no {attr!r}")
    if not callable(target):
        raise TransformImportError(f"transform {spec!r}: {attr!r} is not callable")
    return target


def code_hash(spec: str) -> str:
    """A hash of the transform's code: the source of the module that defines it (the job's
    identity, so that a restart or a worker host with other code is noticed)."""
    fn = load(spec)
    module = sys.modules.get(getattr(fn, "__module__", "") or "") or importlib.import_module(spec.partition(":")[0])
    try:
        text = inspect.getsource(module)
    except (OSError, TypeError):  # no source file (a compiled module): its code objects, as well as we can
        text = repr(getattr(fn, "__code__", None) and fn.__code__.co_code)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class ChatError(ValueError):
    """A conversation that cannot be rendered as asked (the message says why)."""


def find_template(tokenizer_path: str) -> tuple[str, str]:
    """(the chat template, where it came from) of a tokenizer or processor directory (or of the
    directory of a tokenizer.json), or of a template file: `chat_template.jinja` in the directory,
    else `chat_template` in chat_template.json, processor_config.json or tokenizer_config.json (a
    string, or a list of named templates: the one named "default")."""
    if os.path.isfile(tokenizer_path) and not tokenizer_path.endswith(".json"):  # a template file itself
        with open(tokenizer_path, encoding="utf-8") as f:
            return f.read(), tokenizer_path
    base = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
    file = os.path.join(base, TEMPLATE_FILE)
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return f.read(), file
    # then where transformers also looks: a processor's chat_template.json, the tokenizer's config
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        config = os.path.join(base, name)
        if not os.path.isfile(config):
            continue
        with open(config, "rb") as f:
            template = orjson.loads(f.read()).get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if isinstance(template, str) and template:
            return template, config
    raise ChatError(f"{base}: no chat template ({TEMPLATE_FILE}, or chat_template in chat_template.json or "
                    "tokenizer_config.json)")


def environment() -> Any:
    """The jinja environment transformers renders chat templates in (sandboxed; generation tags)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(Extension):
        """`{% generation %}...{% endgeneration %}`: record the character span of what it renders."""

        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            environment.extend(generation_spans=ContextVar("generation_spans", default=None))

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller: Any) -> str:
            text = caller()
            tracking = self.environment.generation_spans.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_template(tokenizer_path: str) -> Any:
    """The tokenizer's chat template, compiled; raises ChatError naming where it came from."""
    template, origin = find_template(tokenizer_path)
    try:
        return environment().from_string(template)
    except Exception as e:  # jinja2's TemplateSyntaxError
        raise ChatError(f"{origin}: the chat template does not compile ({e})") from None
