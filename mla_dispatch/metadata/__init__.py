"""The scheduling-metadata layer under every backend: the split-KV work partition (:mod:`.schedule`, with its
one-launch Triton form in :mod:`.schedule_triton`), the combine of split results (:mod:`.combine`) and the
conversions vendor adapters need (:mod:`.conversions`)."""
