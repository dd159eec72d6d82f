"""The pictures in the documentation, made again from a real job:

    python tools/docs_images.py --status tcp://127.0.0.1:5555 --out docs/img/status.svg   # msd status, as a terminal
    shows it
    python tools/docs_images.py --report STATE_DIR --out docs/img/report.png             # msd report's page at 1280
    pixels

The report is opened in headless Chromium (tests/browser.py) and cut to its first 1,250 pixels.
"""

from __future__ import annotations

import os
import sys
import tempfile

import click

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@click.command()
@click.option("--status", "address", default=None, help="A running coordinator's address: draw msd status.")
@click.option("--report", "state_dir", default=None, help="A state dir: draw msd report's HTML page.")
@click.option("--out", required=True, help="The picture to write (.svg for --status, .png for --report).")
def main(address: str | None, state_dir: str | None, out: str) -> None:
    if address:
        from rich.console import Console

        from coordinator.status_view import fetch_status, render

        console = Console(record=True, width=120, file=open(os.devnull, "w"))
        console.print(render(fetch_status(address)))
        console.save_svg(out, title="msd status")
    if state_dir:
        from click.testing import CliRunner
        from PIL import Image

        from msd.cli import main as msd
        from tests.browser import look

        with tempfile.TemporaryDirectory() as tmp:
            page, shot = os.path.join(tmp, "report.html"), os.path.join(tmp, "report.png")
            r = CliRunner().invoke(msd, ["report", "--state-dir", state_dir, "--out", page])
            if r.exit_code:
                raise click.ClickException(r.output)
            url = "file://" + page
            look([url], screenshot={url: shot})
            image = Image.open(shot)
            image.crop((0, 0, image.width, min(image.height, 1250))).save(out, optimize=True)


if __name__ == "__main__":
    main()
