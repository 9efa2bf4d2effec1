"""tools/sass_identity.py's fingerprint: what it treats as the same machine code (addresses,
branch label numbers, the function's own name, the program-wide numbers of the compiler's
internal subroutines) and what it does not (any instruction)."""

from __future__ import annotations

import importlib.util
import pathlib

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "sass_identity.py"
_spec = importlib.util.spec_from_file_location("sass_identity", TOOL)
sass_identity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_identity)

SECTION = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @P0 BRA `(.L_x_{a}) ;
        /*0020*/                   CALL.REL.NOINC `($__internal_{n}_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;
.L_x_{a}:
        /*0030*/                   RET.REL.NODEC R4 `({name}) ;
"""


def _fp(a=7, n=3, name="_Z1fv", mov="MOV R1, c[0x0][0x28]"):
    return sass_identity.fingerprint(SECTION.format(a=a, n=n, name=name).replace(
        "MOV R1, c[0x0][0x28]", mov), name)


def test_same_code_in_another_program_fingerprints_the_same():
    # label and internal-subroutine numbers depend on the other functions of the program
    assert _fp() == _fp(a=74, n=4, name="_Z1gv")
    assert _fp()["instructions"] == 4


def test_an_instruction_change_is_seen():
    assert _fp()["sha"] != _fp(mov="MOV R1, c[0x0][0x2c]")["sha"]
