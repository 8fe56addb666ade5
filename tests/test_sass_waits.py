"""tools/sass_waits.py on two instructions of a real `cuobjdump -sass` listing (the fp8 mma
@split of 21e8fe0: the fallback block-table load and the join that waited on it and on q's
loads), their control bits decoded by hand below."""
import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "sass_waits.py"

LISTING = """\
        /*06f0*/                   LDG.E.CONSTANT R2, desc[UR12][R2.64] ;                   /* 0x0000000c02027981 */
                                                                                            /* 0x000968000c1e9900 */
        /*0700*/                   VIMNMX R2, RZ, R2, !PT ;                                 /* 0x00000002ff027248 */
                                                                                            /* 0x024fe20007fe0100 */
"""


def _tool():
    spec = importlib.util.spec_from_file_location("sass_waits", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_control_bits_by_hand():
    # high word >> 41, fields from bit 0: stall 4, yield 1, write barrier 3, read barrier 3, wait mask 6.
    # 0x000968000c1e9900: bits 41-44 = 0100 -> stall 4; 46-48 = 101 -> W5; 49-51 = 100 -> R4; no wait.
    # 0x024fe20007fe0100: stall 1; write/read 7 (none); bits 52-57 = 001001 -> waits on 2 and 5.
    tool = _tool()
    assert tool.control(0x000968000c1e9900) == {"stall": 4, "yield": 1, "write": 5, "read": 4, "wait": []}
    assert tool.control(0x024fe20007fe0100) == {"stall": 1, "yield": 1, "write": 7, "read": 7, "wait": [2, 5]}


def test_listing_decoded_and_printed(tmp_path, capsys):
    tool = _tool()
    rows = list(tool.decode(LISTING.splitlines()))
    assert [(a, t.split()[0]) for a, t, _ in rows] == [("06f0", "LDG.E.CONSTANT"), ("0700", "VIMNMX")]
    path = tmp_path / "split.sass"
    path.write_text(LISTING)
    tool.main([str(path), "--loads"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("06f0 LDG.E.CONSTANT") and out[0].endswith("st 4 W5 R4")
    assert out[1].startswith("0700 VIMNMX") and out[1].endswith("st 1 wait[2,5]")
