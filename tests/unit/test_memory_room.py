"""The memory the bench may use: MemAvailable, or less under a control group's limit."""

from tf_hsm.bench import watchdog


def _group(root, path, files):
  directory = root.joinpath(*[p for p in path.split("/") if p])
  directory.mkdir(parents=True, exist_ok=True)
  for name, text in files.items():
    (directory / name).write_text(text)


def test_v2_limits_of_the_group_and_those_above_it(tmp_path):
  proc = tmp_path / "cgroup"
  proc.write_text("0::/machine/job\n")
  mount = tmp_path / "fs"
  _group(mount, "/machine/job", {"memory.max": "max\n", "memory.current": "100\n"})
  assert watchdog.cgroup_room_bytes(str(proc), str(mount)) is None  # no limit set
  _group(mount, "/machine", {"memory.max": "5000\n", "memory.current": "1000\n"})
  assert watchdog.cgroup_room_bytes(str(proc), str(mount)) == 4000
  _group(mount, "/machine/job", {"memory.max": "3000\n"})
  assert watchdog.cgroup_room_bytes(str(proc), str(mount)) == 2900
  _group(mount, "/machine/job", {"memory.current": "3500\n"})  # past the limit: no room
  assert watchdog.cgroup_room_bytes(str(proc), str(mount)) == 0
  # The inactive page cache counted in the usage is room: the kernel reclaims it.
  _group(mount, "/machine/job", {"memory.current": "2900\n",
                                 "memory.stat": "anon 500\ninactive_file 2000\n"})
  assert watchdog.cgroup_room_bytes(str(proc), str(mount)) == 2100


def test_v1_memory_controller_and_a_host_path_seen_from_a_container(tmp_path):
  proc = tmp_path / "cgroup"
  proc.write_text("5:cpu,cpuacct:/job\n4:memory:/host/containers/abc\n0::/\n")
  mount = tmp_path / "fs"
  # The container sees its own group at the mount's root, not at the host's path.
  _group(mount, "/memory", {"memory.limit_in_bytes": "8000", "memory.usage_in_bytes": "500"})
  assert watchdog.cgroup_room_bytes(str(proc), str(mount)) == 7500
  # v1 counts the hierarchy's cache as total_inactive_file (inactive_file is the group's).
  _group(mount, "/memory", {"memory.stat": "inactive_file 100\ntotal_inactive_file 300\n"})
  assert watchdog.cgroup_room_bytes(str(proc), str(mount)) == 7800
  # v1's "no limit" is a huge number, not "max".
  _group(mount, "/memory", {"memory.limit_in_bytes": "9223372036854771712"})
  assert watchdog.cgroup_room_bytes(str(proc), str(mount)) is None


def test_no_cgroup_file_is_no_limit(tmp_path):
  assert watchdog.cgroup_room_bytes(str(tmp_path / "missing"), str(tmp_path)) is None


def test_the_room_bounds_mem_available(monkeypatch):
  monkeypatch.setattr(watchdog, "cgroup_room_bytes", lambda: 1_000)
  assert watchdog.mem_available_bytes() == 1_000
  monkeypatch.setattr(watchdog, "cgroup_room_bytes", lambda: None)
  assert watchdog.mem_available_bytes() > 1_000


def test_the_default_limit_follows_what_is_available(monkeypatch):
  monkeypatch.setattr(watchdog, "mem_available_bytes", lambda: 5e9)
  assert watchdog.limit_gb_or_default(None) == 4.0  # a GB kept free
  assert watchdog.limit_gb_or_default(30.0) == 30.0  # asked for: taken as asked
  monkeypatch.setattr(watchdog, "mem_available_bytes", lambda: 0)
  assert watchdog.limit_gb_or_default(None) == 1.0  # nothing free is not "unknown"
  monkeypatch.setattr(watchdog, "mem_available_bytes", lambda: None)
  assert watchdog.limit_gb_or_default(None) == watchdog.DEFAULT_LIMIT_GB
