# Filters the output of .ci/vllm-env.sh: vLLM is installed with --no-deps on purpose, so pip's
# post-install check lists each of vLLM's own requirements as unmet ("vllm 0.26.0 requires X,
# which is not installed", "... requires torch==2.11.0, but you have torch 2.13.0+cpu"): about
# 40 lines a release under an "ERROR: pip's dependency resolver ..." header, although pip exits
# 0. Those lines are left out and counted. Any other line is printed, the header too where a
# conflict of another package follows it, so a real conflict still shows; the exit status of
# the build is the script's own (.ci/run runs it under pipefail).
/^ERROR: pip's dependency resolver does not currently take into account/ {
  header = $0; in_block = 1; next
}
in_block && /^vllm [^ ]+ requires / { hidden++; next }
in_block && / requires .*(, which is not installed\.|, but you have .* which is incompatible\.)$/ {
  if (header != "") { print header; header = "" }
  print; fflush(); next
}
{ in_block = 0; header = ""; print; fflush() }
END {
  if (hidden) printf "vllm-env: left out %d lines of pip's resolver listing vLLM's own requirements (unmet on purpose: vLLM is installed with --no-deps)\n", hidden
}
