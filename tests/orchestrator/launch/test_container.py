"""``container=pyxis|apptainer``: the srun line in the script the dry run prints (which is the one
submitted: ``submit.sbatch_script`` renders the executor's own), the mounts derived from the config,
and the refusals before submission. The run through a real (stand-in) runtime on the local SLURM
cluster is in tests/slurm/test_container_on_slurm.py."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from jobs.train import container_paths, load_config
from orchestrator.config import (
    ClusterConfig,
    ConfigError,
    ContainerConfig,
    ParallelismConfig,
    register_configs,
)
from orchestrator.launch import container, submit
from orchestrator.training import trainer

register_configs()


def srun_line(cluster: ClusterConfig, parallelism: ParallelismConfig, run_dir: Path,
              paths: list[tuple[str, str | Path | None]] = ()) -> list[str]:  # type: ignore[assignment]
    needs = [container.Need(key, path) for key, path in paths]
    executor = submit.make_executor(cluster, parallelism, run_dir / "submitit", None, needs)
    [line] = [line for line in submit.sbatch_script(executor).splitlines() if line.startswith("srun ")]
    return shlex.split(line)


def slurm(box: ContainerConfig) -> ClusterConfig:
    return ClusterConfig(mode="slurm", dry_run=True, container=box)


def test_pyxis_puts_the_image_mounts_and_a_per_run_name_on_srun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    box = ContainerConfig(runtime="pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3", env=["HF_TOKEN"])
    argv = srun_line(slurm(box), ParallelismConfig(nodes=2, gpus_per_node=8), tmp_path / "run",
                     [("data.path", data)])
    assert "warning: container=pyxis: this cluster's srun has no --container-image" in capsys.readouterr().err
    start = argv.index("--kill-on-bad-exit=1") + 1
    assert argv[start:] == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        # the submitting directory holds the run and the data here: one mount covers them
        f"--container-mounts={tmp_path}:{tmp_path}",
        f"--container-workdir={tmp_path}",
        "--container-env=PYTHONPATH,PYTHONSAFEPATH,SWITCHYARD_SNAPSHOT,SWITCHYARD_IMAGE,"
        "SWITCHYARD_SUBMITTED_VERSION,HF_TOKEN",
        f"--container-name={container.container_name(tmp_path / 'run', box)}",
        "--no-container-mount-home", "--container-readonly",
        "python", "-u", "-m", "submitit.core._submit", str(tmp_path / "run" / "submitit")]
    # a requeue (the same run directory and image) names the same container: pyxis imports the
    # image once; another run, another image or a rebuilt image file gets its own
    name = container.container_name(tmp_path / "run", box)
    assert name == container.container_name(tmp_path / "run", dataclasses.replace(box, env=[]))
    assert name != container.container_name(tmp_path / "other", box)
    assert name != container.container_name(tmp_path / "run", dataclasses.replace(box, image="other:1"))
    local = dataclasses.replace(box, image=str(tmp_path / "torch.sqsh"))
    (tmp_path / "torch.sqsh").write_bytes(b"one")
    built = container.container_name(tmp_path / "run", local)
    (tmp_path / "torch.sqsh").write_bytes(b"rebuilt")
    assert container.container_name(tmp_path / "run", local) != built


def test_a_local_image_reaches_the_nodes_by_its_absolute_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "torch.sqsh").write_bytes(b"image")
    for image in ("~/torch.sqsh", "./torch.sqsh"):
        box = ContainerConfig(runtime="pyxis", image=image)
        args = container.srun_args(box, [], tmp_path / "run")
        assert args[0] == f"--container-image={tmp_path / 'torch.sqsh'}", image
        assert container.setup_lines(box)[0].startswith(f"export SWITCHYARD_IMAGE={tmp_path / 'torch.sqsh'} ")


def test_a_pyxis_dry_run_without_srun_here_warns_and_a_submission_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    box = ContainerConfig(runtime="pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3")
    [warning] = container.check(box, dry_run=True)
    assert "container=pyxis needs srun to check for pyxis" in warning and "shown unchecked" in warning
    with pytest.raises(ConfigError, match="container=pyxis needs srun to check for pyxis"):
        container.check(box)


@pytest.mark.parametrize("gpus, flag", [(8, ["--nv"]), (0, [])])
def test_apptainer_runs_the_images_python_with_nv_on_gpu_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              gpus: int, flag: list[str]) -> None:
    cwd, data, image = tmp_path / "code", tmp_path / "data", tmp_path / "torch.sif"
    for d in (cwd, data, tmp_path / "run"):
        d.mkdir()
    image.write_bytes(b"sif")
    monkeypatch.chdir(cwd)
    box = ContainerConfig(runtime="apptainer", image=str(image), mounts=[f"{tmp_path}/data:/ro:ro"])
    argv = srun_line(slurm(box), ParallelismConfig(gpus_per_node=gpus), tmp_path / "run",
                     [("data.path", data / "train"), ("checkpoint.dir", None)])
    start = argv.index("--kill-on-bad-exit=1") + 1
    binds = argv[start + 4 + len(flag)].split(",")
    assert sorted(binds[:3]) == sorted(f"{p}:{p}" for p in (cwd, data, tmp_path / "run"))
    assert binds[3:] == [f"{data}:/ro:ro"]  # the user's, after the derived ones
    assert argv[start:] == ["apptainer", "exec", *flag, "--no-home", "--bind", ",".join(binds),
                            "--pwd", str(cwd), str(image), "python", "-u", "-m", "submitit.core._submit",
                            str(tmp_path / "run" / "submitit")]


def test_every_path_the_train_config_names_is_mounted(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    places = {k: tmp_path / k for k in ("train", "eval", "cache", "ckpt", "elsewhere")}
    for p in places.values():
        p.mkdir()
    image = tmp_path / "torch.sif"
    image.write_bytes(b"sif")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = load_config(compose(config_name="train", overrides=[
            "cluster=slurm", "container=apptainer", f"cluster.container.image={image}",
            f"data.cache_dir={places['cache']}", f"checkpoint.dir={places['ckpt']}/new"]))
    paths = trainer.DataPaths(train=str(places["train"]), eval=str(places["eval"]))  # data.path, eval_path
    wanted = container_paths(cfg, paths, tmp_path / "run")
    # the demo dataset (data.path null): its cache too
    assert {n.why for n in wanted if n.path} == {"data.path", "data.eval_path", "data.cache_dir",
                                                 "checkpoint.dir"}
    assert [n.why for n in wanted if n.made] == ["checkpoint.dir"]  # made at submission, to be mounted
    monkeypatch.chdir(places["elsewhere"])  # the cwd no longer covers them: each is its own mount
    box = cfg.cluster.container
    assert {m.target for m in container.mounts_for(box, wanted, dry_run=True)} == {
        str(places[k]) for k in ("train", "eval", "cache")} | {str(places["ckpt"] / "new")}
    assert not (places["ckpt"] / "new").exists()  # a dry run makes nothing
    container.mounts_for(box, wanted)
    assert (places["ckpt"] / "new").is_dir()  # a submission makes it, so it is mounted at its own path
    # not there yet: its nearest existing parent, never the root (that would replace the image's)
    deeper = places["train"] / "a" / "b"
    assert [m.target for m in container.needed([container.Need("data.path", deeper)])] == [
        str(places["train"])]
    assert container.needed([container.Need("checkpoint.resume_from", "/no-such-dir-c38/step-4.pt")]) == []


def refused(box: ContainerConfig, needs: list[container.Need] = (), srun_help: str = "") -> str:  # type: ignore[assignment]
    with pytest.raises(ConfigError) as e:
        container.check(box, srun_help=srun_help)
        container.mounts_for(box, needs, dry_run=True)
    return str(e.value)


def test_bad_container_values_are_refused_before_submission(tmp_path: Path) -> None:
    image = tmp_path / "torch.sif"
    image.write_bytes(b"sif")
    assert refused(ContainerConfig(runtime="apptainer", image=str(tmp_path / "gone.sif"))).startswith(
        f"cluster.container.image='{tmp_path}/gone.sif' is invalid: no such file on this machine")
    assert "srun has no --container-image option: pyxis" in refused(
        ContainerConfig(runtime="pyxis", image="ubuntu:24.04"), srun_help="Usage: srun [OPTIONS...]")
    assert "its source /nonexistent does not exist" in refused(
        ContainerConfig(runtime="apptainer", image=str(image), mounts=["/nonexistent:/x"]))
    data = container.Need("data.path", tmp_path / "data")
    said = refused(ContainerConfig(runtime="apptainer", image=str(image), mounts=[f"{image}:{tmp_path}"]),
                   [data])
    assert f"its target {tmp_path} would hide {tmp_path}/data, which the job needs (data.path)" in said
    for bad in ("/x;rm -rf ~", "$(id)", "a b", "#x"):
        with pytest.raises(ConfigError, match=r"shell metacharacters are refused"):
            ContainerConfig(runtime="apptainer", image=bad)
    with pytest.raises(ConfigError, match=r"env\[0\]='A=1' is invalid: a variable name"):
        ContainerConfig(runtime="pyxis", image="ubuntu", env=["A=1"])
    with pytest.raises(ConfigError, match=r"container='apptainer' is invalid: a container runs the ranks "
                                          r"of a SLURM job.*\(try cluster=slurm\)"):
        ClusterConfig(mode="local", container=ContainerConfig(runtime="apptainer", image="x"))


def test_a_missing_apptainer_is_a_warning_not_a_refusal(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The submitting machine may lack it where the nodes have it."""
    monkeypatch.setenv("PATH", str(tmp_path))
    box = ContainerConfig(runtime="apptainer", image="docker://python:3.12")
    assert container.check(box) == ["container=apptainer: neither apptainer nor singularity is on this "
                                    "machine's PATH; the job needs it on the nodes' PATH"]


def test_provenance_names_the_image_and_a_resume_under_another_is_refused(tmp_path: Path) -> None:
    from orchestrator.launch import provenance
    from orchestrator.training import resume
    from orchestrator.training.checkpoint import CheckpointError

    image = tmp_path / "torch.sif"
    image.write_bytes(b"one image")
    box = ContainerConfig(runtime="apptainer", image=str(image))
    cluster = ClusterConfig(mode="slurm", container=box, snapshot=dataclasses.replace(
        ClusterConfig().snapshot, enabled=False))
    run = tmp_path / "run"
    run.mkdir()
    provenance.at_submission(cluster, [], run, "config: 1")
    recorded = provenance.read(run)
    digest = "sha256:" + hashlib.sha256(b"one image").hexdigest()
    assert recorded is not None and recorded["image"] == {"runtime": "apptainer", "image": str(image),
                                                          "digest": digest}
    assert f"image: {image} (apptainer, {digest})" in provenance.lines(recorded)  # switchyard show
    saved = provenance.for_checkpoint(run)
    assert resume.check_code(saved, run / "step-1.pt", False, run) is None
    image.write_bytes(b"another image")  # resubmitted under a rebuilt image
    provenance.at_submission(cluster, [], run, "config: 1")
    with pytest.raises(CheckpointError, match=rf"container image {digest} -> sha256:"):
        resume.check_code(saved, run / "step-1.pt", False, run)
    assert resume.check_code(saved, run / "step-1.pt", True, run) is not None  # allow_code_change


def test_a_sweeps_points_share_one_array_with_the_sweep_dir_and_their_data_mounted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    from orchestrator.sweeps.arrays import Resources
    from orchestrator.sweeps.points import Point, add_containers

    code, image, sweep = tmp_path / "code", tmp_path / "torch.sif", tmp_path / "multirun"
    data = tmp_path.parent / f"{tmp_path.name}-data"
    image.write_bytes(b"sif")
    for d in (code, data):
        d.mkdir(exist_ok=True)
    monkeypatch.chdir(code)  # the sweep is not inside the submitting directory: its own mount
    cluster = ClusterConfig(mode="slurm", container=ContainerConfig(runtime="apptainer", image=str(image)))
    resources = Resources("slurm", submit.slurm_parameters(cluster, ParallelismConfig()), 3, 10, "cluster")
    task_cfg = OmegaConf.create({"data": {"path": str(data)}})
    points = [Point(num, [f"optim.lr={num}"], OmegaConf.create(), task_cfg, sweep / str(num), resources,
                    True, None, cluster=cluster) for num in range(2)]
    elsewhere = tmp_path / "elsewhere" / "2"  # hydra.sweep.subdir an absolute path
    points.append(Point(2, ["optim.lr=2"], OmegaConf.create(), task_cfg, elsewhere, resources, True,
                        None, cluster=cluster))
    add_containers(points, sweep)
    assert points[0].resources.key() == points[1].resources.key()  # one array
    python = points[0].resources.params["python"]
    assert python.startswith("apptainer exec --no-home --bind ")
    assert sorted(python.split(" --bind ")[1].split(" ")[0].split(",")) == sorted(
        [f"{code}:{code}", f"{sweep}:{sweep}", f"{data}:{data}"])  # the sweep dir, not each run dir
    binds = points[2].resources.params["python"].split(" --bind ")[1].split(" ")[0].split(",")
    assert f"{elsewhere}:{elsewhere}" in binds  # a run directory outside the sweep's


def test_an_installed_switchyard_in_the_image_must_be_the_submitters_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the snapshot the image's own Switchyard runs; with it, the snapshot's (the
    submitter's code, whatever the image has installed)."""
    env = {container.IMAGE_ENV: "/images/old.sif", container.VERSION_ENV: "0.2.0"}
    monkeypatch.setattr(container, "own_version", lambda: "0.1.0")  # what the image has installed
    assert container.rank_check(env, from_snapshot=False) == (
        "the image /images/old.sif has Switchyard 0.1.0 installed, the submitter has 0.2.0: install "
        "Switchyard 0.2.0 in the image, or leave cluster.snapshot.enabled=true (the ranks then import "
        "the submitter's code from its snapshot)")
    assert container.rank_check(env, from_snapshot=True) is None
    assert container.rank_check({**env, container.VERSION_ENV: "0.1.0"}, from_snapshot=False) is None
    assert container.rank_check({}, from_snapshot=False) is None  # no container


def test_a_rank_refuses_an_image_whose_switchyard_differs_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(container.IMAGE_ENV, "/images/old.sif")
    monkeypatch.setenv(container.VERSION_ENV, "9.9.9")
    monkeypatch.delenv("SWITCHYARD_SNAPSHOT", raising=False)
    with pytest.raises(submit.RankFailed, match=r"^the image /images/old.sif has Switchyard \S+ installed, "
                                                r"the submitter has 9.9.9"):
        submit.RankEntry(lambda: "ran")()


def test_jobs_train_refuses_a_missing_image_in_one_line_and_queues_nothing(tmp_path: Path) -> None:
    from train_helpers import CHEAP, run_train

    proc = run_train("cluster=slurm", "cluster.dry_run=true", "container=apptainer",
                     f"cluster.container.image={tmp_path}/gone.sif", *CHEAP, run_dir=tmp_path / "run",
                     cache_dir=tmp_path / "cache")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == (
        f"error: cluster.container.image='{tmp_path}/gone.sif' is invalid: no such file on this machine "
        f"(try the path of an image file you built ({tmp_path} holds no image file), or a registry image: "
        f"cluster.container.image=docker://pytorch/pytorch)")
    assert "#SBATCH" not in proc.stdout


def test_a_missing_image_file_is_refused_proposing_the_image_files_beside_it(tmp_path: Path) -> None:
    """The fix proposed /images/torch.sif whatever was missing: the very path refused, when that
    was the one given. It proposes the closest image file in the same folder now, or else a
    registry image in the runtime's own syntax."""
    for name in ("torch-2.5.sif", "jax.sif", "notes.txt"):
        (tmp_path / name).write_text("x")
    typo = refused(ContainerConfig(runtime="apptainer", image=str(tmp_path / "torch-2.4.sif")))
    assert typo.endswith(f"(try cluster.container.image={tmp_path}/torch-2.5.sif; {tmp_path} also "
                         f"holds jax.sif)")
    gone = refused(ContainerConfig(runtime="pyxis", image="/images/torch.sqsh"),
                   srun_help="--container-image")
    assert gone.endswith("(try the path of an image file you built (/images does not exist), or a registry "
                         "image: cluster.container.image=nvcr.io#nvidia/pytorch:24.05-py3)")


def test_apptainer_passes_variables_as_apptainerenv_whole_commas_and_spaces_included(tmp_path: Path) -> None:
    """``--env NAME=$NAME`` on the command line split a value at its commas (apptainer's list
    syntax) and at its spaces (the shell), and lost to the image's own PYTHONPATH: the job script
    now exports APPTAINERENV_NAME, for the variables that are set."""
    image = tmp_path / "torch.sif"
    image.write_text("image")
    box = ContainerConfig(runtime="apptainer", image=str(image), env=["HF_TOKEN", "WANDB_TAGS"])
    assert "--env" not in (container.python(box, [], 0) or "")
    script = "\n".join([*container.setup_lines(box), "env | grep ^APPTAINERENV_ | sort"])
    env = {"PATH": os.environ["PATH"], "HF_TOKEN": "a b,c=d", "PYTHONPATH": "/snap:/x,y"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    passed = dict(line.removeprefix("APPTAINERENV_").split("=", 1) for line in out.splitlines())
    assert passed["HF_TOKEN"] == "a b,c=d" and passed["PYTHONPATH"] == "/snap:/x,y"
    assert passed[container.IMAGE_ENV] == str(image)  # the script's own, for rank_check
    assert "WANDB_TAGS" not in passed and "PYTHONSAFEPATH" not in passed  # unset: not passed


def test_a_missing_path_is_never_mounted_through_a_top_level_directory(tmp_path: Path) -> None:
    """Climbing to the nearest existing parent of /opt/ckpt/run bound the host's /opt over the
    image's (where images keep their Python): such a path stays missing, for the job to report."""
    assert container.needed([container.Need("checkpoint.resume_from", "/opt/switchyard-missing/run")]) == []
    assert container.needed([container.Need("checkpoint.resume_from", "/switchyard-missing/run")]) == []
    deep = tmp_path / "a" / "b"
    assert container.needed([container.Need("checkpoint.resume_from", deep)]) == [
        container.Mount(tmp_path, str(tmp_path), why="checkpoint.resume_from")]
    usr = container.Mount(Path("/usr"), "/usr", why="data.path")
    assert container.needed([container.Need("data.path", "/usr")]) == [usr]  # named itself: mounted


# ------------------------------------------------------------------------------------------------
# Mounts refused or followed before submission, and the batch script's own check (issue 53, item 10)


def apptainer(tmp_path: Path, mounts: list[str] = ()) -> ContainerConfig:  # type: ignore[assignment]
    image = tmp_path / "torch.sif"
    image.write_bytes(b"sif")
    return ContainerConfig(runtime="apptainer", image=str(image), mounts=list(mounts))


def binds(cluster: ClusterConfig, run_dir: Path, paths: list[tuple[str, str | Path | None]]) -> list[str]:
    argv = srun_line(cluster, ParallelismConfig(), run_dir, paths)
    return argv[argv.index("--bind") + 1].split(",")


@pytest.mark.parametrize("separator", [",", ":"])
@pytest.mark.parametrize("key", ["data.path", "checkpoint.dir", "hydra.run.dir"])
def test_a_path_that_the_mount_list_would_split_is_refused_naming_its_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, separator: str) -> None:
    """``--bind``/``--container-mounts`` are SRC:DST[:ro],...: a ',' or ':' in a mounted path split
    it, and the job failed on the node. One inside a mount that has neither is no problem."""
    (tmp_path / "code").mkdir()
    monkeypatch.chdir(tmp_path / "code")  # the submitting directory covers none of them
    bad = tmp_path / f"a{separator}b"
    run_dir = tmp_path / "run"
    paths: list[tuple[str, str | Path | None]] = [("data.path", tmp_path / "data"),
                                                  ("checkpoint.dir", tmp_path / "ckpt")]
    if key == "hydra.run.dir":
        run_dir = bad
    else:
        paths = [(k, bad if k == key else p) for k, p in paths]
    for path in (run_dir, *(p for _, p in paths)):
        Path(path).mkdir()
    with pytest.raises(ConfigError) as e:
        binds(slurm(apptainer(tmp_path)), run_dir, paths)
    assert str(e.value) == (
        f"{key}={str(bad)!r} is invalid: it holds {separator!r}, which the container's mount list "
        f"(apptainer --bind, pyxis --container-mounts: SRC:DST,...) reads as separators, so the job "
        f"would fail on the node (try {key}=<a path without ',' or ':'>, or rename the directory "
        f"that holds them)")
    monkeypatch.chdir(tmp_path)  # now one mount holds them all, and its path has neither
    assert binds(slurm(apptainer(tmp_path)), run_dir, paths) == [f"{tmp_path}:{tmp_path}"]


@pytest.mark.parametrize("target", ["{run}/submitit", "{run}/checkpoints", "{run}/x/../submitit"])
def test_a_mount_target_inside_the_run_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             target: str) -> None:
    """The job's logs and results went into the user's mount: the submitting side never saw them,
    waited 60 s and failed. ``..`` is resolved first, as the runtime resolves it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    run = tmp_path / "run"
    spec = f"{tmp_path}/src:{target.format(run=run)}"
    with pytest.raises(ConfigError) as e:
        binds(slurm(apptainer(tmp_path, [spec])), run, [])
    inside = os.path.normpath(target.format(run=run))
    assert str(e.value) == (
        f"cluster.container.mounts[0]={spec!r} is invalid: its target {inside} lies inside {run} "
        f"(hydra.run.dir), which the job needs whole: what the job writes there would go into "
        f"{tmp_path}/src instead, unseen by the submitting side and the checks (try "
        f"cluster.container.mounts[0]={tmp_path}/src:<a target outside {run}>)")


def test_a_mount_target_with_dots_is_resolved_before_it_is_checked(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``SRC:/x/../data`` hides ``/data`` as ``SRC:/data`` does, which was refused: now both are."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    data = tmp_path / "data"
    data.mkdir()
    for target in (f"{data}", f"{tmp_path}/elsewhere/../data", f"{tmp_path}/./data/"):
        spec = f"{tmp_path}/src:{target}"
        with pytest.raises(ConfigError, match=rf"its target {data} would hide {data}, which the job "
                                              r"needs \(data.path\)"):
            binds(slurm(apptainer(tmp_path, [spec])), tmp_path / "run", [("data.path", data)])
    # a target beside them, reached through '..', is mounted at the path the runtime uses
    spec = f"{tmp_path}/src:/opt/x/../extra:ro"
    assert binds(slurm(apptainer(tmp_path, [spec])), tmp_path / "run", [("data.path", data)])[-1] == (
        f"{tmp_path}/src:/opt/extra:ro")


def test_a_symlinked_data_directory_is_mounted_where_it_leads(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``data -> /scratch/ds`` under the submitting directory: the mount of that directory held the
    link, not the dataset, and the rank found no data. Where a link leads is mounted too (a link
    that stays inside the mount needs nothing); a destination the mount list would split is refused."""
    code, outside = tmp_path / "code", tmp_path.parent / f"{tmp_path.name}-scratch"
    (outside / "ds").mkdir(parents=True)
    (code / "inner").mkdir(parents=True)
    (code / "data").symlink_to(outside / "ds")
    (code / "same").symlink_to("inner")  # relative, inside the mount
    monkeypatch.chdir(code)
    box = slurm(apptainer(tmp_path))
    assert sorted(binds(box, code / "run", [("data.path", code / "data" / "train"),
                                            ("data.eval_path", code / "same")])) == sorted(
        [f"{code}:{code}", f"{outside}/ds:{outside}/ds"])
    (outside / "a,b").mkdir()
    (code / "split").symlink_to(outside / "a,b")
    with pytest.raises(ConfigError) as e:
        binds(box, code / "run", [("data.path", code / "split")])
    assert str(e.value).startswith(
        f"data.path='{code}/split' is invalid: its mount {outside}/a,b (where it leads through a "
        f"symlink: {outside}/a,b) holds ',', which the container's mount list")


def test_a_dry_run_makes_no_checkpoint_directory_and_shows_the_mount_the_job_would_get(
        tmp_path: Path) -> None:
    """It made checkpoint.dir on the submitting machine (even /scratchx/ckpt under /)."""
    image = tmp_path / "torch.sif"
    image.write_bytes(b"sif")
    scratch = tmp_path.parent / f"{tmp_path.name}-scratchx"  # beside the submitting directory
    ckpt = scratch / "ckpt"
    try:
        proc = run_train_dry(tmp_path, f"cluster.container.image={image}", f"checkpoint.dir={ckpt}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not scratch.exists()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    srun = shlex.split(next(line for line in proc.stdout.splitlines() if line.startswith("srun ")))
    assert f"{ckpt}:{ckpt}" in srun[srun.index("--bind") + 1].split(",")  # as the submission would


def run_train_dry(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    from train_helpers import CHEAP, run_train

    return run_train("cluster=slurm", "cluster.dry_run=true", "container=apptainer", *overrides, *CHEAP,
                     f"cluster.snapshot.dir={tmp_path / 'store'}", run_dir=tmp_path / "run",
                     cache_dir=tmp_path / "cache", cwd=tmp_path)


def test_the_batch_script_checks_the_snapshot_without_the_submitting_machines_python(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The script ran ``.venv/bin/python -I -c ...`` on the batch node, outside the image: where
    that Python is not on the node (the usual case with a container) every job failed there. The
    script's lines before srun run here with this Python's directories hidden (an empty tmpfs over
    each, in a mount namespace of their own) and nothing but /usr/bin:/bin on PATH."""
    from orchestrator.config import SnapshotConfig
    from orchestrator.launch import snapshot

    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare --mount)")
    monkeypatch.chdir(tmp_path)
    code = snapshot.take(SnapshotConfig(dir=str(tmp_path / "store")))
    cluster = slurm(apptainer(tmp_path))
    executor = submit.make_executor(cluster, ParallelismConfig(), tmp_path / "run" / "submitit", code)
    script = submit.sbatch_script(executor)
    before_srun = script[:script.index("\nsrun ")] + "\necho the ranks would start\n"

    def batch_node(text: str) -> subprocess.CompletedProcess[str]:
        hidden = [os.path.realpath(Path(sys.executable).parent), os.path.realpath(sys.base_prefix)]
        hide = " && ".join(f"mount -t tmpfs tmpfs {shlex.quote(d)}" for d in hidden)
        gone = f"test ! -e {shlex.quote(sys.executable)} || exit 99"  # the hiding itself is checked
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               f"{hide} && {gone} && exec env -i PATH=/usr/bin:/bin bash -c "
                               f"{shlex.quote(text)}"], capture_output=True, text=True, timeout=60)

    whole = batch_node(before_srun)
    assert whole.returncode == 0 and whole.stdout == "the ranks would start\n", whole.stderr
    (code.path / "orchestrator" / "cli.py").unlink()
    broken = batch_node(before_srun)
    assert broken.returncode == 1 and broken.stdout == ""
    assert broken.stderr.startswith(f"error: the code snapshot {code.path} of this job is incomplete "
                                    f"(orchestrator/cli.py gone): it was deleted after")
