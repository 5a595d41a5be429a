"""The page at / without a browser: what is served, with which types, behind which key; the
metrics its status panel reads; the flag that turns it off."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Live
from tests.server.fake_engine import FakeEngine
from vkrt.engine.async_llm import EngineMetrics
from vkrt.errors import VkrtError
from vkrt.server.metrics import ServerMetrics
from vkrt.server.webui import UI_DIR, UI_FILES, page_url, read_ui_files


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


TYPES = {"/": "text/html", "/ui/app.js": "text/javascript", "/ui/style.css": "text/css"}


def test_the_page_and_its_files_are_served_with_their_types(fake: Live) -> None:
    for path, media_type in TYPES.items():
        response = fake.client.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-type"] == f"{media_type}; charset=utf-8"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert "script-src 'self'" in response.headers["content-security-policy"]
    page = fake.client.get("/").text
    assert '<script src="/ui/app.js"' in page and 'href="/ui/style.css"' in page


def test_only_the_listed_files_are_served(fake: Live) -> None:
    for path in ("/ui/", "/ui/index.html", "/ui/../webui.py", "/index.html", "/ui/app.js.map"):
        assert fake.client.get(path).status_code == 404, path


def test_the_page_loads_nothing_from_elsewhere() -> None:
    """No CDN: every URL in the files is a path on this server."""
    for name, _ in UI_FILES.values():
        source = (UI_DIR / name).read_text()
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", source, re.IGNORECASE), name
        for url in re.findall(r'(?:src|href)="([^"]*)"', source):
            assert url.startswith("/"), (name, url)


def test_disable_ui_answers_404(serve_fake: Any) -> None:
    live = serve_fake(disable_ui=True)
    for path in TYPES:
        assert live.client.get(path).status_code == 404, path
    assert live.client.get("/v1/models").status_code == 200


def test_with_an_api_key_only_the_page_is_open(serve_fake: Any) -> None:
    live = serve_fake(api_key="sk-test")
    for path in TYPES:
        assert live.client.get(path).status_code == 200, path
    for path in ("/metrics", "/v1/models", "/ui/other.js"):
        response = live.client.get(path)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
    bearer = {"Authorization": "Bearer sk-test"}
    assert live.client.get("/metrics", headers=bearer).status_code == 200
    assert live.client.get("/v1/models", headers=bearer).json()["data"][0]["id"] == "fake"
    assert live.client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_public_metrics_stays_public_beside_the_page(serve_fake: Any) -> None:
    live = serve_fake(api_key="sk-test", public_metrics=True)
    assert live.client.get("/metrics").status_code == 200
    assert live.client.get("/v1/models").status_code == 401


def test_the_page_is_not_in_the_api_document(fake: Live) -> None:
    paths = fake.client.get("/openapi.json").json()["paths"]
    assert not set(TYPES) & set(paths)


def test_a_missing_file_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<!doctype html>")
    with pytest.raises(VkrtError, match=r"app\.js cannot be read .*--disable-ui"):
        read_ui_files(tmp_path)


def test_metrics_give_the_panel_the_device_and_live_token_count() -> None:
    stats = EngineMetrics(device="Some GPU", backend="vulkan", device_memory_bytes=8 << 30,
                          device_memory_reserved_bytes=300 << 20, generation_tokens=42)
    got = samples(ServerMetrics(lambda: stats, "m").render().decode())
    assert got[("vkrt_device_info", (("backend", "vulkan"), ("device", "Some GPU")))] == 1
    assert got[("vkrt_device_memory_bytes", ())] == 8 << 30
    assert got[("vkrt_device_memory_reserved_bytes", ())] == 300 << 20
    assert got[("vkrt_engine_generation_tokens_total", ())] == 42
    # Before the model has loaded the info family is there, empty.
    empty = ServerMetrics(lambda: None, "m").render().decode()
    assert "# TYPE vkrt_device_info gauge" in empty and "vkrt_device_info{" not in empty


def test_generation_tokens_count_while_a_request_streams(serve_fake: Any) -> None:
    """The fake engine reports tokens per step as the engine does: the counter the chart reads
    moves before the request finishes."""
    fake = serve_fake(FakeEngine(step_delay=0.05))
    with fake.client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 40, "stream": True}) as r:
        lines = r.iter_lines()
        while '"text": "c"' not in next(lines):
            pass
        mid = samples(fake.client.get("/metrics").text)
    assert mid[("vkrt_generation_tokens_total", ())] == 0  # counted when the request finishes
    assert mid[("vkrt_engine_generation_tokens_total", ())] >= 3


@pytest.mark.parametrize(("host", "url"), [("127.0.0.1", "http://127.0.0.1:8000/"),
                                           ("0.0.0.0", "http://127.0.0.1:8000/"),
                                           ("::", "http://[::1]:8000/"), ("fe80::1", "http://[fe80::1]:8000/"),
                                           ("example.local", "http://example.local:8000/")])
def test_page_url(host: str, url: str) -> None:
    assert page_url(host, 8000) == url


@pytest.mark.parametrize("disable", [False, True])
def test_serve_prints_the_page_address_and_the_flag_turns_it_off(
        disable: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`vkrt serve [--disable-ui]` through the real parser; uvicorn's run is stubbed out, so
    nothing listens and no model loads."""
    import uvicorn

    from vkrt.cli import build_parser

    seen: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(self.config.app))
    args = build_parser().parse_args(["serve", "--port", "8123", *(["--disable-ui"] if disable else [])])
    assert args.func(args) == 0
    err = capsys.readouterr().err
    assert ("chat and status page at http://127.0.0.1:8123/" in err) is not disable
    assert len(seen) == 1 and seen[0].state.server.config.disable_ui is disable


def test_every_file_of_the_page_is_package_data() -> None:
    """The wheel ships what pyproject.toml's package-data names: each UI file must match."""
    import fnmatch
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["vkrt"]
    for file in sorted(UI_DIR.iterdir()):
        relative = file.relative_to(UI_DIR.parents[1]).as_posix()  # server/ui/<name>, under vkrt/
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), relative
    assert {name for name, _ in UI_FILES.values()} <= {f.name for f in UI_DIR.iterdir()}
