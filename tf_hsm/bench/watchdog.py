"""Bench jobs in child processes under an RSS watchdog and a time-out.

Out-of-memory (the watchdog's limit, the kernel's OOM killer, TensorFlow's allocation
errors) and time-outs become a job's result, never a crash of the bench.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

GB = 1e9
# The directory holding the tf_hsm package: an exec'ed worker imports it from there.
_PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _proc_bytes(path, field):
  """The "FIELD: N kB" line of a /proc file, in bytes; None where it cannot be read."""
  try:
    with open(path) as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def _rss_bytes(pid):
  return _proc_bytes(f"/proc/{pid}/status", "VmRSS")


DEFAULT_LIMIT_GB = 18.0


def limit_gb_or_default(limit_gb):
  """LIMIT_GB, or where it is None the bench's default: 18 GB, less where less is
  available now (a GB kept free, 1 GB at the least)."""
  if limit_gb is not None:
    return limit_gb
  available = mem_available_bytes()
  if available is None:
    return DEFAULT_LIMIT_GB
  return max(1.0, min(DEFAULT_LIMIT_GB, available / GB - 1.0))


def mem_available_bytes():
  """The memory available to new processes, in bytes, or None: the kernel's
  MemAvailable, or less where this process's control group has a memory limit (a
  container's: MemAvailable counts the whole machine's)."""
  available = _proc_bytes("/proc/meminfo", "MemAvailable")
  room = cgroup_room_bytes()
  if room is None:
    return available
  return room if available is None else min(available, room)


# The memory controller's directories under the cgroup mount (v2: one hierarchy, mounted
# alone or beside v1 as unified/), and its files: limit, usage, the usage's inactive
# page cache in memory.stat.
_CGROUP_V2 = (("", "unified"), "memory.max", "memory.current", "inactive_file")
_CGROUP_V1 = (("memory",), "memory.limit_in_bytes", "memory.usage_in_bytes",
              "total_inactive_file")


def cgroup_room_bytes(proc_cgroup="/proc/self/cgroup", mount="/sys/fs/cgroup"):
  """The least room (limit less usage), in bytes, of the memory limits set on this
  process's control group and the groups above it, or None where none is set or none
  can be read. A v2 group is its "0::PATH" line; a v1 group the "N:...memory...:PATH"
  line. Inside a container the path may be the host's: then the levels that exist
  under the container's mount are read, the mount's own among them."""
  try:
    with open(proc_cgroup) as f:
      lines = [line.rstrip("\n").split(":", 2) for line in f]
  except OSError:
    return None
  rooms = []
  for hierarchy, controllers, path in (l for l in lines if len(l) == 3):
    if hierarchy == "0" and not controllers:
      files = _CGROUP_V2
    elif "memory" in controllers.split(","):
      files = _CGROUP_V1
    else:
      continue
    parts = [p for p in path.split("/") if p]
    for directory in files[0]:
      for depth in range(len(parts), -1, -1):
        room = _level_room(os.path.join(mount, directory, *parts[:depth]), *files[1:])
        if room is not None:
          rooms.append(room)
  return min(rooms) if rooms else None


def _level_room(level, limit_file, usage_file, cache_field):
  """One group's room, or None where it sets no limit. The usage counts the page cache;
  its inactive part is reclaimed before the group runs out (as `docker stats` counts
  it)."""
  limit = _read_int(os.path.join(level, limit_file))
  usage = _read_int(os.path.join(level, usage_file))
  if limit is None or usage is None or limit >= 2**60:  # v1's "no limit" is huge
    return None
  cache = _stat_bytes(os.path.join(level, "memory.stat"), cache_field)
  return max(limit - usage + min(cache, usage), 0)


def _stat_bytes(path, field):
  """FIELD's value in a cgroup's memory.stat, 0 where it cannot be read."""
  try:
    with open(path) as f:
      for line in f:
        name, _, value = line.partition(" ")
        if name == field:
          return int(value)
  except (OSError, ValueError):
    pass
  return 0


def _read_int(path):
  """The integer a cgroup file holds, None for "max" or where it cannot be read."""
  try:
    with open(path) as f:
      return int(f.read().strip())
  except (OSError, ValueError):
    return None


class Child:
  """One worker job, killed when its RSS passes `limit_bytes` or it runs longer than
  `timeout_s`.

  spawn="fork": a fork of this process runs `tf_hsm.bench.worker.main` (this process imported
  TensorFlow but never ran an op, so the child starts TF's runtime fresh) — saves the
  seconds of importing TF per job. spawn="exec": a new interpreter,
  `python -m tf_hsm.bench.worker SPEC`.
  """

  def __init__(self, spec, workdir, limit_bytes, timeout_s, label, spawn="fork"):
    self.label = label
    self.limit, self.timeout = limit_bytes, timeout_s
    fd, self.spec_path = tempfile.mkstemp(suffix=".json", dir=workdir)
    self.result_path = self.spec_path[:-5] + ".result.json"
    self.log_path = self.spec_path[:-5] + ".log"
    with os.fdopen(fd, "w") as f:
      json.dump(dict(spec, result_path=self.result_path), f)
    self.start = time.monotonic()
    self.max_rss = 0
    self.killed_for = None
    self.result = None
    self.returncode = None
    if spawn == "fork":
      self.pid = self._fork()
    else:
      env = dict(os.environ)
      env["PYTHONPATH"] = os.pathsep.join(
          [_PACKAGE_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
      env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
      with open(self.log_path, "w") as log:
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "tf_hsm.bench.worker", self.spec_path],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_PACKAGE_PARENT)
      self.pid = self._popen.pid

  def _fork(self):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
      return pid
    code = 1
    try:  # The child: never returns into the driver.
      fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      os.dup2(fd, 1)
      os.dup2(fd, 2)
      os.close(fd)
      from tf_hsm.bench import worker  # pylint: disable=import-outside-toplevel
      worker.main([worker.__file__, self.spec_path])
      code = 0
    except BaseException:  # pylint: disable=broad-except
      import traceback  # pylint: disable=import-outside-toplevel
      traceback.print_exc()
    finally:
      try:
        sys.stdout.flush()
        sys.stderr.flush()
      finally:
        os._exit(code)  # pylint: disable=protected-access

  def poll(self):
    """Checks the child once; returns its result dict when it has ended, else None."""
    if self.result is not None:
      return self.result
    pid, status, usage = os.wait4(self.pid, os.WNOHANG)
    if pid == 0:
      rss = _rss_bytes(self.pid)
      if rss is not None:
        self.max_rss = max(self.max_rss, rss)
        if rss > self.limit and self.killed_for is None:
          self.killed_for = ("OOM", f"RSS {rss / GB:.2f} GB passed the limit "
                                    f"{self.limit / GB:.2f} GB")
          self._kill()
      if (time.monotonic() - self.start > self.timeout and self.killed_for is None):
        self.killed_for = ("timeout", f"no result after {self.timeout:.0f} s")
        self._kill()
      return None
    self.returncode = os.waitstatus_to_exitcode(status)
    if hasattr(self, "_popen"):
      self._popen.returncode = self.returncode
    self.result = self._collect(usage.ru_maxrss * 1024)
    return self.result

  def _kill(self):
    try:
      os.kill(self.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass

  def _log_tail(self, chars=3000):
    """The end of the child's output, without TF's start-up chatter."""
    try:
      with open(self.log_path, errors="replace") as f:
        text = f.read()
    except OSError:
      return ""
    noise = ("cuda", "Extension modules:", "oneDNN", "cpu_feature_guard", "To enable the",
             "absl::InitializeLog")
    lines = [l for l in text.splitlines()
             if l.strip() and not any(n.lower() in l.lower() for n in noise)]
    return "\n".join(lines)[-chars:]

  def _collect(self, child_maxrss):
    seconds = time.monotonic() - self.start
    if self.killed_for is not None:
      status, message = self.killed_for
      result = {"status": status, "message": message}
    elif os.path.exists(self.result_path):
      with open(self.result_path) as f:
        result = json.load(f)
    else:
      code = self.returncode
      tail = self._log_tail()
      oom_words = ("bad_alloc", "out of memory", "resource_exhausted", "oom")
      if code == -signal.SIGKILL or any(w in tail.lower() for w in oom_words):
        result = {"status": "OOM", "message": f"killed (exit {code}); likely the kernel "
                                              "OOM killer or an allocation failure"}
      else:
        last = tail.splitlines()[-1] if tail else ""
        result = {"status": "error", "message": f"worker exited with {code}: {last[-200:]}"}
    result["wall_s"] = seconds
    result["watchdog_max_rss"] = self.max_rss
    result["child_maxrss"] = child_maxrss
    if result.get("status") == "error" and "log_tail" not in result:
      result["log_tail"] = self._log_tail()
    return result


def run_children(specs, workdir, limit_bytes, timeout_s, jobs, progress, spawn):
  """Runs the specs, `jobs` at a time, each under the watchdog; results in order."""
  pending = list(enumerate(specs))
  running, results = [], [None] * len(specs)
  while pending or running:
    while pending and len(running) < jobs:
      i, (label, spec, timeout) = pending.pop(0)
      running.append((i, Child(spec, workdir, limit_bytes, timeout or timeout_s, label,
                                spawn)))
    time.sleep(0.02)
    for item in list(running):
      i, child = item
      result = child.poll()
      if result is not None:
        results[i] = result
        running.remove(item)
        progress(f"    {child.label}: {result.get('status')} "
                 f"({result['wall_s']:.1f} s{_peak_note(result)})")
  return results


def _peak_note(result):
  peak = result.get("peak_rss")
  return f", peak RSS {peak / GB:.2f} GB" if peak else ""

