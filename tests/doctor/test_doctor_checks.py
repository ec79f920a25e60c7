"""Each machine check as a pure function: constructed Platform, Plan and HostFacts in, a Finding out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from unsloth.doctor import checks
from unsloth.doctor.checks import Needs
from unsloth.doctor.host import DeviceNode, RcLine
from unsloth.matrix import load_matrix
from unsloth.plan import Advice
from unsloth.platform.facts import Gpu, Platform

GIB = 2**30
URLS = {"nvidia_driver": "https://www.nvidia.com/en-us/drivers/", "rocm_install": "https://rocm.example/linux",
        "rocm_wsl": "https://rocm.example/wsl"}


def linux(**fields) -> Platform:
    return Platform(os="linux", wsl=False, machine="x86_64", **fields)


# --- GPU, support, plan advice -----------------------------------------------------------------

def test_no_gpu_is_a_plain_warning_not_an_error(make_plan):
    finding = checks.check_gpu(linux(), make_plan())
    assert (finding.status, finding.required) == ("warning", False)
    assert finding.message == "No GPU found: training will run on the CPU (slow)"
    assert "nvidia-smi" in finding.fix


def test_gpus_the_plan_cannot_use_say_why(make_plan):
    old = Gpu(vendor="nvidia", name="GeForce GTX 680", arch="sm_30", family="Kepler")
    plan = make_plan(device_reason="Kepler is too old for every PyTorch CUDA build",
                     warnings=[Advice("Kepler: CPU only", fix="use a Turing or newer GPU")])
    finding = checks.check_gpu(linux(gpus=[old]), plan)
    assert finding.status == "warning"
    assert "1 GPU(s) found, none usable: Kepler is too old" in finding.message
    assert finding.fix == "use a Turing or newer GPU"


def test_planned_gpu_is_named_with_its_arch_and_memory(make_plan, rtx4090):
    igpu = Gpu(vendor="amd", name="AMD Radeon Graphics", arch="gfx1036", integrated=True)
    finding = checks.check_gpu(linux(gpus=[igpu, rtx4090]), make_plan("cuda", "cu130", rtx4090))
    assert finding.status == "ok"
    assert finding.message == "NVIDIA GeForce RTX 4090 (sm_89, 24 GiB) (+1 more)"


def test_support_levels(make_plan, rtx4090):
    assert checks.check_support(make_plan("cuda", "cu130", rtx4090)).status == "ok"
    limited = checks.check_support(make_plan(warnings=[Advice("x", fix="buy a GPU")]))
    assert (limited.status, limited.fix) == ("warning", "buy a GPU")
    assert limited.message == "Limited support: no usable GPU"
    unsupported = checks.check_support(make_plan(support="unsupported", reason="RDNA1 has no ROCm wheels"))
    assert unsupported.message == "Unsupported: RDNA1 has no ROCm wheels"  # not "Unsupported support"
    missing = checks.check_support(None, "hardware_matrix.toml: not valid TOML")
    assert missing.fails and "not valid TOML" in missing.message


def test_each_plan_warning_becomes_a_finding_with_its_fix(make_plan):
    plan = make_plan(warnings=[Advice("a", fix="do a"), Advice("b")])
    found = checks.check_plan_advice(plan)
    assert [(f.id, f.message, f.fix) for f in found] == [("plan-advice-1", "a", "do a"), ("plan-advice-2", "b", None)]
    assert checks.check_plan_advice(None) == []


def test_advice_about_a_fact_doctor_judged_itself_is_said_once(make_plan):
    # Advice.check names the doctor check covering the same fact (the plan sets it where one does).
    about_driver = SimpleNamespace(message="No NVIDIA driver was detected", fix="install it", check="driver")
    other = SimpleNamespace(message="UNSLOTH_TORCH_INDEX_URL pins a rocm build", fix="unset it", check=None)
    plan = make_plan(warnings=[about_driver, other])
    assert [f.message for f in checks.check_plan_advice(plan, {"driver", "gpu"})] == [other.message]
    # On a dump the check may be skipped; then the plan's advice is all there is, and it stays.
    assert len(checks.check_plan_advice(plan, {"gpu"})) == 2


# --- driver and runtime ------------------------------------------------------------------------

def test_old_nvidia_driver_fails_with_the_minimum_in_the_fix(make_plan, rtx4090):
    platform = linux(gpus=[rtx4090], nvidia_driver="535.104.05", cuda_driver="12.2")
    finding = checks.check_driver(platform, make_plan("cuda", "cu130", rtx4090), Needs("580", urls=URLS))
    assert finding.fails
    assert finding.message == "NVIDIA driver 535.104.05 is older than 580, which torch cu130 needs"
    assert finding.fix == "Update the NVIDIA driver to 580 or newer from https://www.nvidia.com/en-us/drivers/, then reboot"


def test_a_driver_too_old_for_any_cuda_build_is_a_warning_when_the_plan_fell_back_to_cpu(make_plan, rtx4090):
    platform = linux(gpus=[rtx4090], nvidia_driver="470.256.02")
    needs = checks.needs_from_matrix(load_matrix(), platform, make_plan())  # no CUDA row: the oldest minimum
    finding = checks.check_driver(platform, make_plan(), needs)
    assert (finding.status, finding.required) == ("warning", False)
    assert finding.message == ("NVIDIA driver 470.256.02 is older than 525.60.13, which the oldest PyTorch CUDA "
                               "build needs: training runs on the CPU")


def test_under_wsl_the_driver_fix_points_at_windows(make_plan, rtx4090):
    platform = Platform(os="linux", wsl=True, wsl_version=2, gpus=[rtx4090], nvidia_driver="566.36")
    finding = checks.check_driver(platform, make_plan("cuda", "cu130", rtx4090), Needs("580"))
    assert finding.fails and "on Windows (not inside WSL)" in finding.fix


def test_new_enough_driver_is_ok_and_says_what_it_needed(make_plan, rtx4090):
    platform = linux(gpus=[rtx4090], nvidia_driver="580.126.09")
    finding = checks.check_driver(platform, make_plan("cuda", "cu130", rtx4090), Needs("580"))
    assert finding.status == "ok"
    assert finding.message == "NVIDIA driver 580.126.09 (torch cu130 needs 580)"


def test_nvidia_gpu_without_driver(make_plan, rtx4090):
    finding = checks.check_driver(linux(gpus=[rtx4090], probes={"lspci": "ok"}), make_plan(), Needs("580"))
    assert finding.status == "error" and not finding.required  # the plan fell back to the CPU
    assert "no driver answered" in finding.message and "(580 or newer)" in finding.fix
    # nvidia-smi -L in a dump lists GPUs without the driver version: unknown, not missing.
    listed = linux(gpus=[rtx4090], probes={"nvidia-smi": "ok"})
    assert checks.check_driver(listed, make_plan(), Needs("580")).status == "skipped"


def test_amd_kernel_driver_from_dev_kfd(make_plan, rx7800):
    plan = make_plan("rocm", "rocm7.2", rx7800)
    missing = checks.check_driver(linux(gpus=[rx7800], dev_kfd=False), plan, Needs(urls=URLS))
    assert missing.fails and "amdgpu-install" in missing.fix and URLS["rocm_install"] in missing.fix
    assert checks.check_driver(linux(gpus=[rx7800], dev_kfd=True), plan, Needs()).status == "ok"
    assert checks.check_driver(linux(), make_plan(), Needs()) is None


@pytest.mark.parametrize(("cuda_driver", "variant", "status"), [
    ("12.2", "cu128", "ok"),  # minor-version compatibility: a 12.x driver runs every 12.y build
    ("13.0", "cu130", "ok"),
    ("12.9", "cu130", "error"),
])
def test_cuda_runtime_follows_the_major_version(make_plan, rtx4090, cuda_driver, variant, status):
    platform = linux(gpus=[rtx4090], nvidia_driver="580.1", cuda_driver=cuda_driver)
    finding = checks.check_runtime(platform, make_plan("cuda", variant, rtx4090), Needs())
    assert finding.status == status
    assert finding.required == (status == "error")


def test_rocm_runtime(make_plan, rx7800):
    plan = make_plan("rocm", "rocm7.2", rx7800)
    absent = checks.check_runtime(linux(gpus=[rx7800]), plan, Needs(urls=URLS))
    assert (absent.status, absent.required) == ("skipped", False)  # the wheels bring their own ROCm
    windows = Platform(os="windows", gpus=[rx7800])
    assert checks.check_runtime(windows, make_plan("rocm", "gfx110X-all", rx7800), Needs()) is None
    wsl = Platform(os="linux", wsl=True, gpus=[rx7800])
    on_wsl = checks.check_runtime(wsl, plan, Needs(urls=URLS))
    assert on_wsl.fails and "HSA_ENABLE_DXG_DETECTION=1" in on_wsl.fix and URLS["rocm_wsl"] in on_wsl.fix
    old = checks.check_runtime(linux(gpus=[rx7800], rocm_version="6.3.1"), plan, Needs(rocm="7.2"))
    assert old.status == "warning" and "older than 7.2" in old.message
    assert checks.check_runtime(linux(gpus=[rx7800], rocm_version="7.2.1"), plan, Needs(rocm="7.2")).status == "ok"
    assert checks.check_runtime(linux(), make_plan(), Needs()) is None


def test_needs_come_from_the_matrix_rows(make_plan, rtx4090):
    matrix = load_matrix()
    native = checks.needs_from_matrix(matrix, linux(), make_plan("cuda", "cu128", rtx4090))
    assert native.nvidia_driver == "525.60.13"
    # Under WSL nvidia-smi reports the Windows driver, so the Windows minimum applies.
    wsl = checks.needs_from_matrix(matrix, Platform(os="linux", wsl=True), make_plan("cuda", "cu128", rtx4090))
    assert wsl.nvidia_driver == "528.33"
    rocm = checks.needs_from_matrix(matrix, linux(), make_plan("rocm", "rocm7.2"))
    assert (rocm.rocm, rocm.nvidia_driver) == ("7.2", "525.60.13")  # no CUDA build: the oldest one's minimum
    assert rocm.urls["rocm_install"].startswith("https://")


# --- device access (native Linux, AMD) --------------------------------------------------------

def test_device_access_needs_the_live_machine(make_plan, rx7800):
    plan = make_plan("rocm", "rocm7.2", rx7800)
    platform = linux(gpus=[rx7800], dev_kfd=True)
    assert checks.check_kfd_access(platform, plan, None).status == "skipped"
    assert checks.check_dri_access(platform, plan, None).status == "skipped"


def test_no_access_to_kfd_asks_for_the_render_group(make_plan, make_host, rx7800):
    host = make_host(groups=["ada"], member_of=[], kfd=DeviceNode("/dev/kfd", False, "render"))
    finding = checks.check_kfd_access(linux(gpus=[rx7800], dev_kfd=True), make_plan("rocm", "rocm7.2", rx7800), host)
    assert finding.fails
    assert finding.message == "No read/write access to /dev/kfd (group render); ada is in: ada"
    assert finding.fix.startswith("sudo usermod -aG render,video $USER")


def test_added_to_the_group_but_not_logged_in_again(make_plan, make_host, rx7800):
    host = make_host(groups=["ada"], member_of=["render"], kfd=DeviceNode("/dev/kfd", False, "render"))
    finding = checks.check_kfd_access(linux(gpus=[rx7800], dev_kfd=True), make_plan("rocm", "rocm7.2", rx7800), host)
    assert finding.fails and finding.fix == "Log out and back in (or run `newgrp render`)"


def test_render_nodes(make_plan, make_host, rx7800):
    plan, platform = make_plan("rocm", "rocm7.2", rx7800), linux(gpus=[rx7800], dev_kfd=True)
    assert checks.check_dri_access(platform, plan, make_host()).status == "ok"
    none = checks.check_dri_access(platform, plan, make_host(render_nodes=[]))
    assert none.fails and "modprobe amdgpu" in none.fix
    blocked = make_host(groups=["ada"], member_of=[], render_nodes=[DeviceNode("/dev/dri/renderD128", True, "render"),
                                                      DeviceNode("/dev/dri/renderD129", False, "video")])
    finding = checks.check_dri_access(platform, plan, blocked)
    assert finding.fails and "/dev/dri/renderD129 (group video)" in finding.message


def test_device_access_checks_only_native_linux_amd(make_plan, make_host, rtx4090, rx7800):
    assert checks.check_kfd_access(linux(gpus=[rtx4090]), make_plan("cuda", "cu130", rtx4090), make_host()) is None
    wsl = Platform(os="linux", wsl=True, gpus=[rx7800])
    assert checks.check_dri_access(wsl, make_plan("rocm", "rocm7.2", rx7800), make_host()) is None


# --- WSL, HSA override -------------------------------------------------------------------------

def test_wsl_bridge(make_plan, make_host, rtx4090):
    plan = make_plan("cuda", "cu130", rtx4090)
    assert checks.check_wsl_bridge(linux(), plan, make_host()) is None
    wsl = dict(os="linux", wsl=True, wsl_version=2, gpus=[rtx4090])
    assert checks.check_wsl_bridge(Platform(**wsl, dev_dxg=True), plan, make_host(wsl_lib_dir=True)).status == "ok"
    no_dxg = checks.check_wsl_bridge(Platform(**wsl, dev_dxg=False), plan, make_host(wsl_lib_dir=True))
    assert no_dxg.fails and "wsl --update" in no_dxg.fix
    no_lib = checks.check_wsl_bridge(Platform(**wsl, dev_dxg=True), plan, make_host(wsl_lib_dir=False))
    assert no_lib.fails and "/usr/lib/wsl/lib" in no_lib.message
    assert checks.check_wsl_bridge(Platform(**wsl, dev_dxg=True), plan, None).status == "skipped"
    wsl1 = checks.check_wsl_bridge(Platform(os="linux", wsl=True, wsl_version=1), plan, None)
    assert wsl1.fails and "wsl --set-version <distro> 2" in wsl1.fix


def test_spoofing_override_names_the_rc_line_to_delete(make_plan, make_host, rx7800):
    gpu = Gpu(**{**rx7800.to_json(), "reported_arch": "gfx1100"})
    platform = linux(gpus=[gpu], hsa_override="11.0.0", hsa_override_spoofs=True)
    host = make_host(rc_overrides=[RcLine("~/.bashrc", 42, "export HSA_OVERRIDE_GFX_VERSION=11.0.0")])
    finding = checks.check_hsa_override(platform, make_plan("rocm", "rocm7.2", gpu), host)
    assert finding.status == "warning"
    assert finding.message == "Set to 11.0.0: ROCm reports the real gfx1101 as gfx1100, and this GPU needs no override"
    assert finding.fix == ("unset HSA_OVERRIDE_GFX_VERSION   # and delete it from ~/.bashrc line 42 "
                           "(`export HSA_OVERRIDE_GFX_VERSION=11.0.0`)")
    on_dump = checks.check_hsa_override(platform, make_plan("rocm", "rocm7.2", gpu), None)
    assert "~/.bashrc" in on_dump.fix


def test_override_against_what_the_plan_sets(make_plan):
    igpu = Gpu(vendor="amd", name="Radeon 780M", arch="gfx1103", integrated=True)
    plan = make_plan("rocm", "rocm7.2", igpu, env={"HSA_OVERRIDE_GFX_VERSION": "11.0.0"})
    same = checks.check_hsa_override(linux(gpus=[igpu], hsa_override="11.0.0"), plan, None)
    assert same.status == "ok"
    wrong = checks.check_hsa_override(linux(gpus=[igpu], hsa_override="10.3.0"), plan, None)
    assert wrong.fails and "needs 11.0.0" in wrong.message
    assert checks.check_hsa_override(linux(gpus=[igpu]), plan, None) is None


# --- resources ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("ram", "status"), [(None, "skipped"), (4 * GIB, "warning"), (32 * GIB, "ok")])
def test_ram(ram, status):
    assert checks.check_ram(linux(ram_bytes=ram)).status == status


def test_disk_for_a_new_environment_and_for_work(make_plan, make_host, rx7800):
    rocm = make_plan("rocm", "rocm7.2", rx7800)
    short = checks.check_disk(rocm, make_host(disk_free_bytes=20 * GIB), env_installed=False)
    assert short.fails
    assert short.message == "20 GiB free in /home/ada/.local/share/unsloth; needs about 30 GiB for the rocm environment"
    assert "UNSLOTH_HOME" in short.fix
    assert checks.check_disk(rocm, make_host(disk_free_bytes=20 * GIB), env_installed=True).status == "ok"
    full = checks.check_disk(rocm, make_host(disk_free_bytes=2 * GIB), env_installed=True)
    assert full.status == "error" and not full.required
    assert checks.check_disk(rocm, None, env_installed=False).status == "skipped"


def test_a_global_override_where_the_plan_sets_one_per_node(make_plan):
    igpu = Gpu(vendor="amd", name="Radeon 780M", arch="gfx1103", integrated=True, kfd_node=1)
    dgpu = Gpu(vendor="amd", name="Radeon RX 6700 XT", arch="gfx1031", kfd_node=2)
    plan = make_plan("rocm", "rocm7.2", igpu, env={"HSA_OVERRIDE_GFX_VERSION_1": "11.0.0"})
    finding = checks.check_hsa_override(linux(gpus=[igpu, dgpu], hsa_override="11.0.0"), plan, None)
    assert finding.fails and "HSA_OVERRIDE_GFX_VERSION_1=11.0.0" in finding.message
    assert finding.fix.startswith("unset HSA_OVERRIDE_GFX_VERSION")
