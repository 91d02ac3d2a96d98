"""What a benchmark's JSON says of the machine: the CPU's model and its matrix units, which decide its low-bit and
bfloat16 linears' speeds (the project's CPU machine has been an AMD EPYC and an Intel Xeon with AMX)."""

from shared.provenance import cpu_model


def test_the_cpu_model_names_its_amx_units_where_it_has_them(tmp_path):
    xeon = tmp_path / "xeon"
    xeon.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse2 avx512f "
                    "amx_tile amx_bf16 amx_int8\n")
    epyc = tmp_path / "epyc"
    epyc.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu sse2 avx512f avx512_bf16\n")
    assert cpu_model(xeon) == "Intel(R) Xeon(R) Processor (amx_bf16, amx_int8, amx_tile)"
    assert cpu_model(epyc) == "AMD EPYC 9B14"
    assert cpu_model(tmp_path / "missing") == ""
