"""Reads TensorBoard event files with the `tensorboard` package (its own record reader: length and data CRC32C
checks, Event protos) and prints what it found as JSON:
  {"files": N, "file_version": "...", "scalars": {tag: [[step, value], ...]}}

usage: read_tensorboard.py LOG_DIR
"""
import glob
import json
import os
import sys

from tensorboard.backend.event_processing import event_file_loader


def main(log_dir):
    files = sorted(glob.glob(os.path.join(log_dir, "**", "*tfevents*"), recursive=True))
    out = {"files": len(files), "file_version": None, "scalars": {}}
    for path in files:
        for event in event_file_loader.LegacyEventFileLoader(path).Load():
            if event.HasField("file_version"):
                out["file_version"] = event.file_version
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out["scalars"].setdefault(value.tag, []).append([event.step, value.simple_value])
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
