"""Chat requests as the model sees them and as clients get them back: messages and tools ->
template variables, tool-call and reasoning parsers (whole and streamed). Pure: no torch, no I/O."""
