"""``kvwire lint``: override drift found in source, on small trees written here and on sglang's released wheels."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from kvwire.lint import LintFinding, lint_tree
from kvwire.lint.cli import main


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def at(root: Path, name: str) -> str:
    """How a file of the tree is shown: the path given to lint, joined with the file's path below it."""
    return os.path.join(str(root), *name.split("/"))


BASE = """
    from typing import Optional


    class Manager:
        def send(self, session: str, pages: list[int], dst_layer_ids: Optional[list[int]] = None) -> int:
            return 0

        def worker(self) -> None:
            self.send("s", [1], dst_layer_ids=None)
"""

DRIFTED = "class A:\n    def f(self, x): ...\n\n\nclass B(A):\n    def f(self): ...\n"

KV_WORKER = """
    class KVManager:
        def send_kvcache(self, session, indices, executor, dst_layer_ids=None, dst_device_kv_indices=None):
            return 0

        def transfer_worker(self):
            ret = self.send_kvcache(
                "s",
                [1],
                None,
                dst_layer_ids=[0],
                dst_device_kv_indices=None,
            )
            return ret
"""


def test_missing_parameter_and_keyword_across_modules(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "host/__init__.py": "",
            "host/mooncake/__init__.py": "",
            "host/mooncake/conn.py": KV_WORKER,
            "host/ascend/__init__.py": "",
            "host/ascend/conn.py": """
                from host.mooncake.conn import (
                    KVManager,
                )


                class AscendManager(KVManager):
                    def send_kvcache(self, session, indices, executor, dst_layer_ids=None):
                        return 0
            """,
        },
    )
    sub, base = at(root, "host/ascend/conn.py"), at(root, "host/mooncake/conn.py")
    base_sig = "send_kvcache(self, session, indices, executor, dst_layer_ids=None, dst_device_kv_indices=None)"
    override_sig = "send_kvcache(self, session, indices, executor, dst_layer_ids=None)"
    assert [f.render() for f in lint_tree(root)] == [
        f"[override-missing-parameter] AscendManager.send_kvcache at {sub}:7 overriding KVManager.send_kvcache "
        f"at {base}:2: parameter `dst_device_kv_indices` of the base is missing "
        "(a caller passing `dst_device_kv_indices=` gets a TypeError)\n"
        f"    base:     {base_sig}\n"
        f"    override: {override_sig}\n"
        "    fix:      add `dst_device_kv_indices=None` to AscendManager.send_kvcache, after `dst_layer_ids`",
        f"[override-missing-keyword] AscendManager.send_kvcache at {sub}:7 overriding KVManager.send_kvcache "
        f"at {base}:2: `KVManager.transfer_worker` at {base}:6 passes `dst_device_kv_indices=` to "
        "`self.send_kvcache(...)`, which the override does not accept (a TypeError on every such call)\n"
        f"    base:     {base_sig}\n"
        f"    override: {override_sig}\n"
        "    fix:      add `dst_device_kv_indices=None` to AscendManager.send_kvcache",
    ]


def test_annotations_and_defaults_as_written(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "base.py": BASE,
            "sub.py": """
                from base import Manager


                class Sub(Manager):
                    def send(self, session: str, pages: list[int]) -> int:
                        return 1
            """,
        },
    )
    (finding,) = [f for f in lint_tree(root) if f.rule == "override-missing-parameter"]
    assert finding.base_signature == (
        "send(self, session: str, pages: list[int], dst_layer_ids: Optional[list[int]] = None) -> int"
    )
    assert finding.override_signature == "send(self, session: str, pages: list[int]) -> int"
    assert finding.fix == "add `dst_layer_ids: Optional[list[int]] = None` to Sub.send, after `pages`"


def test_relative_imports_aliases_and_several_levels(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "pkg/__init__.py": "from .a import A as Exported\n",
            "pkg/a.py": """
                class A:
                    def f(self, x, *, key=1):
                        pass
            """,
            "pkg/mid/__init__.py": """
                from ..a import A as Base


                class B(Base):
                    pass
            """,
            "pkg/mid/c.py": """
                from . import B


                class C(B):
                    def f(self, x):
                        pass
            """,
            "pkg/d.py": """
                import pkg.a
                from pkg import a, Exported

                Alias = Exported


                class D(pkg.a.A):
                    def f(self, x):
                        pass


                class E(a.A):
                    def f(self, x):
                        pass


                class F(Alias):
                    def f(self, x):
                        pass
            """,
        },
    )
    found = [(f.subclass, f.base_class, f.line, f.base_line, f.parameter) for f in lint_tree(root)]
    assert found == [
        ("D", "A", 8, 2, "key"),
        ("E", "A", 13, 2, "key"),
        ("F", "A", 18, 2, "key"),
        ("C", "A", 5, 2, "key"),
    ]
    (c_finding,) = [f for f in lint_tree(root / "pkg") if f.subclass == "C"]  # the package itself: pkg.*
    assert c_finding.message == (
        "keyword-only parameter `key` of the base is missing (a caller passing it gets a TypeError)"
    )
    assert c_finding.fix == "add keyword-only `key=1` to C.f"


def test_nearest_definition_is_the_base_and_a_class_may_shadow_its_import(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "base.py": """
                class Base:
                    def run(self, a, b):
                        pass
            """,
            "mid.py": """
                from base import Base


                class Base(Base):
                    def run(self, a, b, c=None):
                        pass
            """,
            "leaf.py": """
                import mid


                class Leaf(mid.Base):
                    def run(self, a, b):
                        pass
            """,
        },
    )
    assert [(f.subclass, f.base_file, f.base_line, f.parameter) for f in lint_tree(root)] == [
        ("Leaf", at(root, "mid.py"), 5, "c")
    ]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("def send(self, *args, **kwargs):", []),
        ("def send(self, session, *args, **kw):", []),
        ("def send(self, session, pages, dst_layer_ids=None, *args, extra=0, **kwargs):", []),
        (
            "def send(self, session, **kw):",
            [
                "parameter `pages` is argument 2 of the base but taken only through `**kw` in the override "
                "(a caller passing it as argument 2 gets a TypeError)",
                "parameter `dst_layer_ids` is argument 3 of the base but taken only through `**kw` in the "
                "override (a caller passing it as argument 3 gets a TypeError)",
            ],
        ),
        (
            "def send(self, *args):",
            [
                "parameter `session` of the base is missing (a caller passing `session=` gets a TypeError)",
                "parameter `pages` of the base is missing (a caller passing `pages=` gets a TypeError)",
                "parameter `dst_layer_ids` of the base is missing (a caller passing `dst_layer_ids=` gets a TypeError)",
            ],
        ),
        (
            "def send(self, session, pages, *, dst_layer_ids=None):",
            [
                "parameter `dst_layer_ids` is argument 3 of the base but keyword-only in the override "
                "(a caller passing it as argument 3 gets a TypeError)",
            ],
        ),
        (
            "def send(self, session, layers, pages, dst_layer_ids=None):",
            [
                "parameter `pages` is argument 2 of the base but argument 3 of the override "
                "(a caller passing it as argument 2 sets `layers` instead)",
                "parameter `dst_layer_ids` is argument 3 of the base but argument 4 of the override "
                "(a caller passing it as argument 3 sets `pages` instead)",
            ],
        ),
        (
            "def send(self, session, pages, dst_layer_ids):",
            [
                "parameter `dst_layer_ids` has a default in the base but none in the override "
                "(a caller leaving it out gets a TypeError)",
            ],
        ),
        (
            "def send(self, session, page_list, dst_layer_ids=None):",
            [
                "parameter `pages` of the base is missing; the override has `page_list` in its place "
                "(a caller passing `pages=` gets a TypeError)",
            ],
        ),
        (
            "def send(self, session, pages, /, dst_layer_ids=None):",
            [
                "parameter `session` is positional-only in the override (a caller passing `session=` gets a TypeError)",
                "parameter `pages` is positional-only in the override (a caller passing `pages=` gets a TypeError)",
            ],
        ),
        (
            "def send(self, session, pages, dst_layer_ids=None, *, trace):",
            [
                "parameter `trace` is required by the override but is not a parameter of the base "
                "(a caller following the base does not pass it: TypeError)",
            ],
        ),
    ],
)
def test_signature_rules(tmp_path: Path, override: str, expected: list[str]) -> None:
    root = write(
        tmp_path,
        {
            "base.py": """
                class Manager:
                    def send(self, session, pages, dst_layer_ids=None):
                        pass
            """,
            "sub.py": f"""
                from base import Manager


                class Sub(Manager):
                    {override}
                        pass
            """,
        },
    )
    assert [f.message for f in lint_tree(root)] == expected


def test_rule_ids_and_fixes(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "m.py": """
                class Base:
                    def a(self, x, y=1): ...
                    def b(self, x, y=1): ...
                    def c(self, x): ...


                class Sub(Base):
                    def a(self, x): ...
                    def b(self, x, y): ...
                    def c(self, x, z): ...
            """
        },
    )
    assert [(f.method, f.rule, f.parameter, f.fix) for f in lint_tree(root)] == [
        ("a", "override-missing-parameter", "y", "add `y=1` to Sub.a, after `x`"),
        ("b", "override-required-parameter", "y", "give it the base's default in Sub.b: `y=1`"),
        ("c", "override-required-parameter", "z", "give `z` a default in Sub.c, or add it to Base.c"),
    ]


def test_keyword_passed_through_self_to_an_override(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "base.py": """
                class Base:
                    def send(self, data, **options):
                        return 0

                    def run(self):
                        return self.send(b"x", flag=True, **{"other": 1})


                class Middle(Base):
                    def tick(self):
                        def later():
                            return self.send(b"y", retries=2)
                        return later()
            """,
            "sub.py": """
                from base import Middle


                class Sub(Middle):
                    def send(self, data, flag=False):
                        return 1
            """,
        },
    )
    (finding,) = lint_tree(root)
    assert finding.rule == "override-missing-keyword"
    assert finding.parameter == "retries"
    assert finding.message == (
        f"`Middle.tick` at {at(root, 'base.py')}:12 passes `retries=` to `self.send(...)`, "
        "which the override does not accept (a TypeError on every such call)"
    )
    assert finding.fix == "add a `retries` parameter to Sub.send, or stop passing it"
    assert finding.to_dict()["callers"] == [{"caller": "Middle.tick", "file": at(root, "base.py"), "line": 12}]


def test_a_caller_overridden_without_super_is_not_a_caller(tmp_path: Path) -> None:
    files = {
        "m.py": """
            class Base:
                def send(self, data, flag=False):
                    return 0

                def run(self):
                    return self.send(b"x", flag=True)


            class Sub(Base):
                def send(self, data):
                    return 1

                def run(self):
                    return 2


            class Other(Base):
                def send(self, data):
                    return 1

                def run(self):
                    return super().run()
        """
    }
    findings = lint_tree(write(tmp_path, files))
    assert [(f.subclass, f.rule, f.parameter) for f in findings] == [
        ("Sub", "override-missing-parameter", "flag"),
        ("Other", "override-missing-parameter", "flag"),
        ("Other", "override-missing-keyword", "flag"),
    ]
    assert findings[2].message.startswith(f"`Base.run` at {at(tmp_path, 'm.py')}:6 passes `flag=`")


def test_static_and_class_methods_compare_what_callers_pass(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "m.py": """
                import functools


                class Base:
                    @staticmethod
                    def make(a, b=1): ...

                    @classmethod
                    def build(cls, x, y): ...

                    @property
                    def size(self): ...

                    @functools.cached_property
                    def cost(self): ...

                    def helper(self, a): ...

                    def __init__(self, a): ...

                    def __call__(self, a): ...

                    def __secret(self, a): ...


                class Sub(Base):
                    @staticmethod
                    def make(a): ...

                    @classmethod
                    def build(cls, x, y): ...

                    @property
                    def size(self, extra): ...

                    def cost(self, extra): ...

                    @staticmethod
                    def helper(a): ...

                    def __init__(self): ...

                    def __call__(self): ...

                    def __secret(self): ...
            """
        },
    )
    findings = lint_tree(root)
    assert [(f.method, f.parameter) for f in findings] == [("make", "b")]
    assert findings[0].base_signature == "make(a, b=1)"
    assert findings[0].override_signature == "make(a)"


def test_classes_in_blocks_star_imports_and_decorated_methods(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "base.py": '''
                """Module docstring mentioning
                class Fake(Base):
                    def run(self): ...
                """
                import functools

                try:
                    from missing_dependency import Thing
                except ImportError:
                    class Thing:
                        def run(self, a, b=2):
                            pass
                else:
                    pass
            ''',
            "exports.py": "from base import *\n",
            "sub.py": '''
                import functools
                from exports import Thing


                class Sub(Thing):
                    TEMPLATE = """
                    def run(self):
                        pass
                    """
                    total = 1 + \\
                        2

                    @functools.lru_cache(
                        maxsize=None,
                    )
                    def run(self, a):
                        pass
            ''',
        },
    )
    (finding,) = lint_tree(root)
    assert (finding.subclass, finding.line, finding.base_line, finding.parameter) == ("Sub", 16, 11, "b")


def test_source_is_cut_where_python_would_cut_it(tmp_path: Path) -> None:
    """Strings, decorators and comments that look like statements do not fool the cheap split."""
    root = write(
        tmp_path,
        {
            "m.py": """
                import pytest


                class Base:  # a comment after the header
                    def run(self, a, b=2): ...
                    def stop(self, a): ...


                @pytest.mark.skipif(
                    True,
                    reason="this test class\\n"
                    "class Impostor(Base):",
                )
                class Sub(Base):
                    QUOTE = "'''"
                    def stop(self, a): ...
                    WORDS = f"json.loads('''{QUOTE}''')"  # a triple quote in a string, then in a comment: '''
                    def run(self, a): ...


                class Tiny(Base): run = None
            """
        },
    )
    assert [(f.subclass, f.line, f.parameter) for f in lint_tree(root)] == [("Sub", 18, "b")]


def test_unparsable_file_is_skipped_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken_source = """
        from base import Manager


        class Broken(Manager):
            def send(self, session:
                pass
    """
    root = write(
        tmp_path,
        {
            "base.py": BASE,
            "broken.py": broken_source,
            "fine.py": """
                from base import Manager


                class Fine(Manager):
                    def send(self, session, pages): ...
            """,
        },
    )
    with pytest.raises(SyntaxError) as error:
        ast.parse(textwrap.dedent(broken_source).lstrip("\n"))
    assert main([str(root), "--select", "send"]) == 1
    out, err = capsys.readouterr()
    assert err == (
        f"kvwire lint: warning: {at(root, 'broken.py')}: line {error.value.lineno}: "
        f"cannot parse ({error.value.msg}); skipped\n"
    )
    assert "Fine.send" in out
    assert "Broken" not in out


def test_text_output_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean = write(tmp_path / "clean", {"m.py": DRIFTED.replace("f(self)", "f(self, x)")})
    assert main([str(clean)]) == 0
    assert capsys.readouterr() == ("no override drift found\n", "")

    drifted = write(tmp_path / "drifted", {"m.py": DRIFTED})
    assert main([str(drifted)]) == 1
    out, err = capsys.readouterr()
    shown = at(drifted, "m.py")
    assert out == (
        f"[override-missing-parameter] B.f at {shown}:6 overriding A.f at {shown}:2: "
        "parameter `x` of the base is missing (a caller passing `x=` gets a TypeError)\n"
        "    base:     f(self, x)\n"
        "    override: f(self)\n"
        "    fix:      add `x` to B.f, after `self`\n"
        "\n"
        "1 finding(s) in 1 override(s)\n"
    )
    assert err == ""
    assert main([str(drifted / "m.py")]) == 1  # one file
    capsys.readouterr()

    missing = tmp_path / "nowhere"
    assert main([str(missing)]) == 2
    assert capsys.readouterr() == ("", f"kvwire lint: error: {missing}: no such file or directory\n")
    text_file = write(tmp_path, {"notes.txt": "x"}) / "notes.txt"
    assert main([str(text_file)]) == 2
    assert capsys.readouterr() == ("", f"kvwire lint: error: {text_file}: not a directory or a .py file\n")
    with pytest.raises(SystemExit) as exit_info:
        main([str(drifted), "--select", ","])
    assert exit_info.value.code == 2


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write(
        tmp_path,
        {
            "mooncake.py": KV_WORKER,
            "ascend.py": """
                from mooncake import KVManager


                class AscendManager(KVManager):
                    def send_kvcache(self, session, indices, executor, dst_layer_ids=None):
                        return 0

                    def close(self, now): ...
            """,
        },
    )
    assert main([str(root), "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)
    keys = [
        "rule",
        "subclass",
        "method",
        "file",
        "line",
        "base_class",
        "base_file",
        "base_line",
        "parameter",
        "message",
        "base_signature",
        "override_signature",
        "fix",
        "callers",
    ]
    assert [list(f) for f in findings] == [keys, keys]
    assert findings[1] == {
        "rule": "override-missing-keyword",
        "subclass": "AscendManager",
        "method": "send_kvcache",
        "file": at(root, "ascend.py"),
        "line": 5,
        "base_class": "KVManager",
        "base_file": at(root, "mooncake.py"),
        "base_line": 2,
        "parameter": "dst_device_kv_indices",
        "message": f"`KVManager.transfer_worker` at {at(root, 'mooncake.py')}:6 passes `dst_device_kv_indices=` to "
        "`self.send_kvcache(...)`, which the override does not accept (a TypeError on every such call)",
        "base_signature": "send_kvcache(self, session, indices, executor, dst_layer_ids=None, "
        "dst_device_kv_indices=None)",
        "override_signature": "send_kvcache(self, session, indices, executor, dst_layer_ids=None)",
        "fix": "add `dst_device_kv_indices=None` to AscendManager.send_kvcache",
        "callers": [{"caller": "KVManager.transfer_worker", "file": at(root, "mooncake.py"), "line": 6}],
    }
    assert main([str(root), "--json", "--select", "close,flush"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_select_limits_the_methods(tmp_path: Path) -> None:
    root = write(
        tmp_path, {"m.py": DRIFTED.replace("def f(self, x): ...", "def f(self, x): ...\n    def g(self, x): ...")}
    )
    (root / "m.py").write_text((root / "m.py").read_text() + "    def g(self): ...\n")
    assert [f.method for f in lint_tree(root)] == ["f", "g"]
    assert [f.method for f in lint_tree(root, select=["g"])] == ["g"]
    assert lint_tree(root, select=["h"]) == []


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    root = write(tmp_path, {"m.py": DRIFTED})
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire.lint", str(root), "--json"], capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stderr) == (1, "")
    assert [f["parameter"] for f in json.loads(proc.stdout)] == ["x"]


# Real sglang releases, read from their wheels.


@pytest.mark.parametrize("ci", ["", "true"], ids=["locally", "in-ci"])
def test_unreachable_index_skips_with_the_reason_and_fails_in_ci(
    sglang_source: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ci: str
) -> None:
    monkeypatch.setenv("KVWIRE_TEST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CI", ci)
    for variable in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.setenv(variable, "http://127.0.0.1:9/simple/")  # the discard port: refused at once
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_RETRIES", "0")
    reason = r"^package index unreachable: sglang 0\.5\.17 source unavailable: pip download sglang==0\.5\.17 failed: "
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception), match=reason) as exc:
        sglang_source("0.5.17")
    assert exc.type is (pytest.fail.Exception if ci else pytest.skip.Exception)
    assert str(exc.value).endswith("(CI=true: an install test may not skip)") == bool(ci)
    assert not list((tmp_path / "cache").rglob("*.whl"))


SEND_KVCACHE_0_5_17 = (
    "send_kvcache(self, mooncake_session_id: str, prefill_kv_indices: npt.NDArray[np.int32], "
    "dst_kv_ptrs: list[int], dst_kv_indices: npt.NDArray[np.int32], "
    "executor: concurrent.futures.ThreadPoolExecutor, dst_layer_ids: Optional[List[int]] = None"
)


def _send_kvcache_findings(tree: Path) -> list[LintFinding]:
    return lint_tree(tree, select=["send_kvcache"])


@pytest.mark.slow
def test_sglang_0_5_17_ascend_send_kvcache_lacks_dst_device_kv_indices(
    sglang_source: Callable[[str], Path],
) -> None:
    disaggregation = sglang_source("0.5.17") / "sglang" / "srt" / "disaggregation"
    ascend, mooncake = at(disaggregation, "ascend/conn.py"), at(disaggregation, "mooncake/conn.py")
    findings = _send_kvcache_findings(disaggregation)
    assert [(f.rule, f.subclass, f.base_class, f.parameter) for f in findings] == [
        ("override-missing-parameter", "AscendKVManager", "MooncakeKVManager", "dst_device_kv_indices"),
        ("override-missing-keyword", "AscendKVManager", "MooncakeKVManager", "dst_device_kv_indices"),
    ]
    missing, keyword = findings
    assert (missing.file, missing.line, missing.base_file, missing.base_line) == (ascend, 103, mooncake, 771)
    assert missing.override_signature == SEND_KVCACHE_0_5_17 + ")"
    assert missing.base_signature == (
        SEND_KVCACHE_0_5_17 + ", dst_device_kv_indices: Optional[npt.NDArray[np.int32]] = None)"
    )
    assert missing.fix == (
        "add `dst_device_kv_indices: Optional[npt.NDArray[np.int32]] = None` to AscendKVManager.send_kvcache, "
        "after `dst_layer_ids`"
    )
    assert keyword.message == (
        f"`MooncakeKVManager.transfer_worker` at {mooncake}:1675 passes `dst_device_kv_indices=` to "
        "`self.send_kvcache(...)`, which the override does not accept (a TypeError on every such call)"
    )
    assert keyword.fix == (
        "add `dst_device_kv_indices: Optional[npt.NDArray[np.int32]] = None` to AscendKVManager.send_kvcache"
    )


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.5.16", "0.5.18"])
def test_sglang_releases_around_it_have_no_send_kvcache_drift(
    sglang_source: Callable[[str], Path], version: str
) -> None:
    assert _send_kvcache_findings(sglang_source(version) / "sglang" / "srt" / "disaggregation") == []


@pytest.mark.slow
@pytest.mark.parametrize(("version", "drifted"), [("0.5.16", False), ("0.5.17", True), ("0.5.18", False)])
def test_whole_sglang_package(sglang_source: Callable[[str], Path], version: str, drifted: bool) -> None:
    findings = lint_tree(sglang_source(version) / "sglang")
    send = [(f.rule, f.subclass, f.parameter) for f in findings if f.method == "send_kvcache"]
    expected = [
        ("override-missing-parameter", "AscendKVManager", "dst_device_kv_indices"),
        ("override-missing-keyword", "AscendKVManager", "dst_device_kv_indices"),
    ]
    assert send == (expected if drifted else [])
    assert findings  # sglang has other overrides that drift from their bases (see the report of this change)


# -- kvwire lint -------------------------------------------------------------------------------------------------------


def test_an_override_taking_kwargs_accepts_a_keyword_only_base_parameter(tmp_path: Path) -> None:
    source = """
        class Base:
            def f(self, x, *, key=1):
                pass


        class Passes(Base):
            def f(self, x, **kwargs):
                pass


        class Drops(Base):
            def f(self, x):
                pass
    """
    (tmp_path / "mod.py").write_text(textwrap.dedent(source).lstrip("\n"))
    found = [(f.subclass, f.parameter, f.message) for f in lint_tree(tmp_path)]
    assert found == [
        ("Drops", "key", "keyword-only parameter `key` of the base is missing (a caller passing it gets a TypeError)")
    ]  # `Passes` takes key= through **kwargs: no finding
