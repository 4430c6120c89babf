"""The embedded default corpus: English prose from the docstrings of a fixed list of Python standard-library
modules, built offline on any machine with Python (no download, no text stored in this repository).

Deterministic for a given Python version: modules, their public members and docstrings are visited in a fixed,
sorted order; text is split into sentences and tokenized with fixed rules; every 20th sentence (by a CRC of its
text) goes to the held-out split. Different Python versions have somewhat different docstrings.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import zlib

MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bdb", "binascii", "bisect", "builtins", "bz2",
    "calendar", "cmd", "codecs", "collections", "colorsys", "concurrent.futures", "configparser", "contextlib",
    "copy", "copyreg", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "doctest", "email",
    "email.message", "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "gc",
    "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.client",
    "http.cookiejar", "http.server", "imaplib", "importlib", "inspect", "io", "ipaddress", "itertools", "json",
    "keyword", "linecache", "locale", "logging", "logging.handlers", "lzma", "mailbox", "math", "mimetypes",
    "multiprocessing", "netrc", "numbers", "operator", "optparse", "os", "os.path", "pathlib", "pdb", "pickle",
    "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint", "profile", "pstats", "py_compile",
    "pydoc", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex",
    "shutil", "signal", "site", "smtplib", "socket", "socketserver", "sqlite3", "ssl", "stat", "statistics",
    "string", "struct", "subprocess", "symtable", "sys", "sysconfig", "tabnanny", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "token", "tokenize", "trace", "traceback", "tracemalloc", "types",
    "typing", "unittest", "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings", "wave",
    "weakref", "webbrowser", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zipimport", "zlib",
)

_TOKEN = re.compile(r"[A-Za-z]+(?:'[a-z]+)?|\d+(?:\.\d+)?|[^\sA-Za-z\d]")
_SENT_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODEY = re.compile(r"(>>>|\.\.\.|::|==|\(\)|[{}\[\]<>=_@$|\\]|\w\.\w|\w\(|:\s*$)")


def _docstrings(modname: str):
    try:
        mod = importlib.import_module(modname)
    except Exception:  # noqa: BLE001 - a module missing on this platform is skipped
        return
    doc = inspect.getdoc(mod)
    if doc:
        yield doc
    members = []
    for name in sorted(vars(mod)):
        if name.startswith("_"):
            continue
        obj = vars(mod)[name]
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
            members.append(obj)
    for obj in members:
        d = inspect.getdoc(obj)
        if d:
            yield d
        if inspect.isclass(obj):
            for mname in sorted(vars(obj)):
                if mname.startswith("_"):
                    continue
                m = vars(obj)[mname]
                if inspect.isfunction(m) or inspect.ismethoddescriptor(m):
                    d = inspect.getdoc(m)
                    if d:
                        yield d


def _sentences(doc: str):
    for para in re.split(r"\n\s*\n", doc):
        lines = [ln.strip() for ln in para.splitlines()]
        if not lines or any(ln.startswith((">>>", "...", "$", "%", "#")) for ln in lines):
            continue
        if para.startswith((" ", "\t")) or sum(1 for ln in para.splitlines() if ln.startswith("    ")) > 0:
            continue  # indented block: code or a table
        text = re.sub(r":[a-z]+:`([^`]*)`", r"\1", " ".join(lines)).replace("`", "")
        for s in _SENT_END.split(text):
            s = s.strip()
            if not (20 <= len(s) <= 400) or _CODEY.search(s) or not s[0].isupper() or s[-1] not in ".!?":
                continue
            toks = _TOKEN.findall(s)
            words = sum(1 for t in toks if t.isalpha())
            if 4 <= len(toks) <= 60 and words >= 0.7 * len(toks):
                yield toks


def build_sentences(modules=MODULES) -> list[list[str]]:
    """All sentences, de-duplicated, in a fixed order."""
    seen: set[str] = set()
    out: list[list[str]] = []
    for m in modules:
        for doc in _docstrings(m):
            for toks in _sentences(doc):
                key = " ".join(toks)
                if key not in seen:
                    seen.add(key)
                    out.append(toks)
    return out


def default_corpus(directory: str, n_train_shards: int = 4, heldout_every: int = 20) -> dict:
    """Write ``train-0000..`` and ``heldout-0000.txt`` under ``directory`` (idempotent; atomic files)."""
    os.makedirs(directory, exist_ok=True)
    meta_path = os.path.join(directory, "corpus.json")
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
        if meta.get("python") == sys.version.split()[0]:
            return meta
    sents = build_sentences()
    train, held = [], []
    for toks in sents:
        line = " ".join(toks)
        (held if zlib.crc32(line.encode("utf-8")) % heldout_every == 0 else train).append(line)
    shards = [train[i::n_train_shards] for i in range(n_train_shards)]
    files = [(os.path.join(directory, f"train-{i:04d}.txt"), s) for i, s in enumerate(shards)]
    files.append((os.path.join(directory, "heldout-0000.txt"), held))
    for path, lines in files:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
    meta = {"python": sys.version.split()[0], "train_sentences": len(train), "heldout_sentences": len(held),
            "train_tokens": sum(len(s.split()) for s in train), "heldout_tokens": sum(len(s.split()) for s in held)}
    tmp = f"{meta_path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2)
    os.replace(tmp, meta_path)
    return meta
