# Sourced by the device-lease scripts (smollm2_*_lease.sh): leaves MODEL naming the SmolLM2-135M-Instruct folder.
# With MODEL already set (a local dry run) it does nothing. Otherwise it joins the GGUF's two halves (/tmp/ga, kept by
# call 1, and .gpu/g01, carried by call 2), checks them against .gpu/gguf.sha256 and converts them into $W/smol with
# `specgen.assets.smollm2 --gguf`, logging to $CONVERT_LOG; a bad checksum or a failed conversion exits the script.
# Needs PY, W and CONVERT_LOG.
if [ -z "${MODEL:-}" ]; then
  cat /tmp/ga .gpu/g01 > /tmp/smol.gguf && sha256sum -c .gpu/gguf.sha256 || exit 1
  $PY -m specgen.assets.smollm2 --gguf /tmp/smol.gguf --out "$W/smol" > "$CONVERT_LOG" 2>&1 \
    || { tail -5 "$CONVERT_LOG"; exit 1; }
  MODEL=$W/smol
fi
