-- Lint of the Lua scripts in producer/scripts/ as Redis runs them: lib.lua prepended to each script
-- (tests/queue/test_lua_scripts.py joins them). Redis refuses any global a script assigns, so none is allowed.
std = "lua51"
read_globals = {"redis", "cjson", "cmsgpack", "bit", "struct", "KEYS", "ARGV"}
allow_defined = false
allow_defined_top = false
max_line_length = 120
-- lib.lua's helpers are shared: a script need not use every one of them.
ignore = {"211/finish", "211/dead_letter", "211/now_ms", "211/enqueue"}
