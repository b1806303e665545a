"""A repository rule that exposes the pip-installed TensorFlow to Bazel, offline.

It runs the Python interpreter named by TF_HSM_PYTHON (configure.sh writes it into
.tf_hsm.bazelrc), asks tf.sysconfig where the headers and libtensorflow_framework.so.2 live
and which compile flags TensorFlow was built with, and links those in. Nothing is copied or
downloaded, and no flag is hard-coded here.
"""

_QUERY = """
import json, os, tensorflow as tf
lib_dir = tf.sysconfig.get_lib()
link = [f for f in tf.sysconfig.get_link_flags() if f.startswith('-l:')]
print(json.dumps({
    'include': tf.sysconfig.get_include(),
    'lib': lib_dir,
    'library': link[0][3:] if link else 'libtensorflow_framework.so.2',
    'cflags': [f for f in tf.sysconfig.get_compile_flags() if not f.startswith('-I')],
}))
"""

def _local_tensorflow_impl(ctx):
    python = ctx.os.environ.get("TF_HSM_PYTHON", "python3")
    result = ctx.execute([python, "-c", _QUERY], quiet = True)
    if result.return_code != 0:
        fail("Could not import TensorFlow with %s (set by ./configure.sh):\n%s" %
             (python, result.stderr))
    info = json.decode(result.stdout.strip().splitlines()[-1])
    ctx.symlink(info["include"], "include")
    ctx.symlink(info["lib"] + "/" + info["library"], "lib/" + info["library"])
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "tf_headers",
    hdrs = glob(["include/**/*.h", "include/**/*.inc", "include/Eigen/**", "include/unsupported/**",
                 "include/absl/**", "include/third_party/**", "include/google/**"]),
    includes = ["include"],
)

cc_library(
    name = "tf_framework",
    srcs = ["lib/{library}"],
)
""".format(library = info["library"]))
    ctx.file("defs.bzl", "TF_COPTS = %s\n" % repr(info["cflags"]))

local_tensorflow = repository_rule(
    implementation = _local_tensorflow_impl,
    environ = ["TF_HSM_PYTHON"],
    local = True,
)
