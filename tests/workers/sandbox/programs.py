"""Programs several sandbox test modules run."""

# Each defines `add` (numbers, lists concatenated) for call cases graded by the supervisor.
ADDERS = {
    "python": "def add(a, b):\n    return a + b\n",
    "javascript": "function add(a, b) { return Array.isArray(a) ? a.concat(b) : a + b; }\n",
    "ruby": "def add(a, b)\n  a + b\nend\n",
    "php": "<?php\nfunction add($a, $b) { return is_array($a) ? array_merge($a, $b) : $a + $b; }\n",
    "lua": "function add(a, b)\n  if type(a) ~= 'table' then return a + b end\n"
           "  local t = {}\n  for _, x in ipairs(a) do t[#t + 1] = x end\n"
           "  for _, x in ipairs(b) do t[#t + 1] = x end\n  return t\nend\n",
}
