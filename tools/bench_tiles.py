"""Images of the tiled and padded families in a worker (Idefics3, LLaVA-NeXT, LLaVA-OneVision, InternVL),
planned from their sizes against the processor run whole (issue 59): bytes each image sends, and a
worker's CPU per conversation. Both paths are the worker's own code
(worker/processor.ProcessorChat) on the same conversations, alternated over --rounds rounds in this
process (medians, with min and max):

- whole (`image_pass: prepare`, and every source of these families before they were planned):
  `render` runs the processor whole; the sample sends its float32 `pixel_values` (the LLaVA
  models': padded to the sample's most patches) and Idefics3's `pixel_attention_mask` as the
  processor makes it (int64; the worker now sends it as bool);
- planned (the default, `image_pass: delivery`): `render` runs the text pass at prepare time and
  `finish` the resize at delivery; the sample sends uint8 tiles and a recipe.

    python tools/bench_tiles.py --json OUT [--family idefics3] [--records 40] [--rounds 3] [--side 600 1400]

The published configurations (msd/testing/vlm_data.py): Idefics3 resizes to 1456 on the longest
edge and cuts 364-pixel tiles (an image of about a megapixel is 4 x 3 tiles and its global view);
LLaVA-NeXT cuts 336-pixel patches of its best grid pinpoint (up to 1008), LLaVA-OneVision 384-pixel
ones (up to 2304; several images in a turn are resized whole).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tools"))

from bench_output import emit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--records", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--side", type=int, nargs=2, default=(600, 1400), help="image sides drawn from this range")
    ap.add_argument("--family", choices=("idefics3", "llava_next", "llava_onevision", "internvl"), default="idefics3")
    args = ap.parse_args()

    import numpy as np

    from msd.testing import vlm_data
    from msd_common.frames import FRAMES, RECIPE
    from worker.processor import ProcessorChat

    root = tempfile.mkdtemp(prefix="bench-tiles-")
    processor = getattr(vlm_data, f"write_{args.family}_processor")(os.path.join(root, args.family), vocab_size=2000)
    data = os.path.join(root, "data")
    records = vlm_data.write_image_conversations(data, args.records, seed=11, sizes=tuple(args.side), max_images=2)
    planned, whole = ProcessorChat(processor), ProcessorChat(processor, plan_from_sizes=False)
    images = tiles = 0
    sent = {"whole": 0, "planned": 0, "whole_as_sent_now": 0}
    cpu: dict[str, list[float]] = {"whole": [], "planned": []}
    for r in range(args.rounds):
        for name in (("whole", "planned") if r % 2 == 0 else ("planned", "whole")):
            started = time.process_time()
            for record in records:
                if name == "whole":
                    sample = whole.render(record, data)
                    if r == 0 and sample.images:
                        images += sample.images
                        pixels = sample.image_arrays["pixel_values"]
                        mask = sample.image_arrays.get("pixel_attention_mask", np.zeros(0, bool))
                        tiles += int(np.prod(pixels.shape[:-3]))  # (the LLaVA models': padding patches too)
                        sent["whole"] += pixels.nbytes + mask.size * np.dtype(np.int64).itemsize  # as the processor
                        sent["whole_as_sent_now"] += pixels.nbytes + mask.nbytes  # its mask as bool
                else:
                    sample = planned.render(record, data)
                    if sample.pending is not None:
                        planned.finish(sample, "bench")
                        if r == 0:
                            sent["planned"] += sample.image_arrays[FRAMES].nbytes + sample.image_arrays[RECIPE].nbytes
            cpu[name].append((time.process_time() - started) / len(records))

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(values) * 1e3, 1), "min": round(min(values) * 1e3, 1),
                "max": round(max(values) * 1e3, 1)}

    per_image = {k: round(v / images) for k, v in sent.items()}
    emit({
        "family": args.family, "records": args.records, "images": images, "tiles_or_patches": tiles,
        "rounds": args.rounds,
        "bytes_per_image": per_image,
        "planned_over_whole_bytes": round(per_image["planned"] / per_image["whole"], 4),
        "worker_cpu_ms_per_conversation": {k: spread(v) for k, v in cpu.items()},
        "whole_over_planned_cpu": round(statistics.median(cpu["whole"]) / statistics.median(cpu["planned"]), 2),
    }, args.json)


if __name__ == "__main__":
    main()
