"""Tools a chat request offers its model: the request's ``tools`` and ``tool_choice`` checked
(spec), the tool-call text formats models are trained on (formats: the grammar that forces
a call, the parser that reads one), and the calls read from a streamed answer (stream)."""
