"""What each SASS instruction waits for: `cuobjdump -sass` output with the scheduling control
bits of every instruction decoded (Volta and later: bits 105-125 of the 128-bit instruction, i.e.
the high word shifted right by 41: stall cycles, yield, the scoreboard a variable-latency result
sets (W0-W5), the one its source reads release (R0-R5), and the scoreboards it waits on).

    python3 tools/sass_waits.py split.sass                 # every instruction
    python3 tools/sass_waits.py split.sass --loads         # global/shared memory ops, barriers, waits

Why: ptxas has six scoreboards a warp. Loads that share one are waited for together, so a
value that only needs the top-k row can end up waiting for q's loads (the attend's page ids once
waited ~1 us for q that way). How to get the SASS: tools/GPU.md.
"""
import argparse
import re
import sys

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*/\* (0x[0-9a-f]{16}) \*/")
_WORD = re.compile(r"/\* (0x[0-9a-f]{16}) \*/")
_MEMORY = re.compile(r"\b(LDG|STG|LDGSTS|LDGDEPBAR|DEPBAR|LDS|STS|LDC|BAR|RED|ATOM|MEMBAR)\b")


def control(high_word: int) -> dict:
    """The scheduling fields of one instruction from the high 64 bits of its encoding."""
    c = high_word >> 41
    return {"stall": c & 15, "yield": (c >> 4) & 1, "write": (c >> 5) & 7, "read": (c >> 8) & 7,
            "wait": [b for b in range(6) if (c >> 11) >> b & 1]}


def decode(lines):
    """Yields (address, instruction text, control dict) for each instruction of cuobjdump text."""
    i = 0
    while i < len(lines):
        m = _INSTR.search(lines[i])
        high = _WORD.search(lines[i + 1]) if m and i + 1 < len(lines) else None
        if m and high:
            yield m[1], m[2], control(int(high[1], 16))
            i += 2
        else:
            i += 1


def describe(ctl: dict) -> str:
    out = f"st{ctl['stall']:2d}"
    if ctl["write"] != 7:
        out += f" W{ctl['write']}"
    if ctl["read"] != 7:
        out += f" R{ctl['read']}"
    if ctl["wait"]:
        out += " wait[" + ",".join(map(str, ctl["wait"])) + "]"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass", help="cuobjdump -sass output (one function or several)")
    ap.add_argument("--loads", action="store_true",
                    help="only memory operations, barriers and instructions that wait on a scoreboard")
    args = ap.parse_args(argv)
    with open(args.sass) as f:
        lines = f.read().splitlines()
    for address, text, ctl in decode(lines):
        if args.loads and not (_MEMORY.search(text) or ctl["wait"]):
            continue
        print(f"{address} {text:60s} {describe(ctl)}")


if __name__ == "__main__":
    sys.exit(main())
