-- Call server for Lua 5.4 (lua5.4 -e "CRUCIBLE_LINKS = {IN_FD, OUT_FD}" -eTHIS): loads
-- /work/main.lua, then answers the supervisor's calls of the global functions it defined by
-- value until the supervisor closes the pipe. Values cross as the tagged JSON of workers/sandbox/harness/wire.py; Lua has no JSON
-- library in its standard set, so the codec is here (strings are bytes: UTF-8 passes through,
-- which the supervisor decodes; anything else is a malformed reply). This runs in the
-- candidate's process and nothing it sends is trusted: the supervisor compares the results.
local fd_in, fd_out = CRUCIBLE_LINKS[1], CRUCIBLE_LINKS[2]
CRUCIBLE_LINKS = nil
local cin = assert(io.open("/dev/fd/" .. fd_in, "rb"))
local cout = assert(io.open("/dev/fd/" .. fd_out, "wb"))
cout:setvbuf("no")
local builtin = {}
for k in pairs(_G) do builtin[k] = true end

local encode
local function encode_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    local named = { ['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t' }
    return named[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

local function is_list(t)
  local n = 0
  for k in pairs(t) do
    if math.type(k) ~= "integer" or k < 1 then return false end
    n = n + 1
  end
  for i = 1, n do if t[i] == nil then return false end end
  return true, n
end

encode = function(v, depth)
  depth = depth or 0
  if depth > 200 then error("value nested too deeply to send", 0) end
  local kind = type(v)
  if v == nil then return "null" end
  if kind == "boolean" then return v and "true" or "false" end
  if kind == "number" then
    if math.type(v) == "integer" then return string.format("%d", v) end
    if v ~= v then return '{"$f":"nan"}' end
    if v == math.huge then return '{"$f":"inf"}' end
    if v == -math.huge then return '{"$f":"-inf"}' end
    return string.format("%.17g", v):find("[%.eEn]") and string.format("%.17g", v)
      or string.format("%.17g", v) .. ".0"
  end
  if kind == "string" then return encode_string(v) end
  if kind == "table" then
    local list, n = is_list(v)
    local parts = {}
    if list then
      for i = 1, n do parts[i] = encode(v[i], depth + 1) end
      return "[" .. table.concat(parts, ",") .. "]"
    end
    for k, x in pairs(v) do
      parts[#parts + 1] = "[" .. encode(k, depth + 1) .. "," .. encode(x, depth + 1) .. "]"
    end
    return '{"$d":[' .. table.concat(parts, ",") .. "]}"
  end
  error("a " .. kind .. " cannot be passed by value", 0)
end

-- A small recursive-descent JSON reader: the documents come from the supervisor.
local function decode(text)
  local pos = 1
  local value
  local function skip() pos = text:find("[^ \t\r\n]", pos) or #text + 1 end
  local function str()
    local out, i = {}, pos + 1
    while true do
      local c = text:sub(i, i)
      if c == "" then error("unterminated string", 0) end
      if c == '"' then pos = i + 1; return table.concat(out) end
      if c == "\\" then
        local e = text:sub(i + 1, i + 1)
        local map = { b = "\b", f = "\f", n = "\n", r = "\r", t = "\t", ['"'] = '"', ["\\"] = "\\", ["/"] = "/" }
        if e == "u" then
          local code = tonumber(text:sub(i + 2, i + 5), 16)
          if code >= 0xD800 and code <= 0xDBFF and text:sub(i + 6, i + 7) == "\\u" then
            local low = tonumber(text:sub(i + 8, i + 11), 16)
            code = 0x10000 + (code - 0xD800) * 0x400 + (low - 0xDC00)
            i = i + 6
          end
          out[#out + 1] = utf8.char(code)
          i = i + 6
        else
          out[#out + 1] = map[e] or error("bad escape", 0)
          i = i + 2
        end
      else
        out[#out + 1] = c
        i = i + 1
      end
    end
  end
  value = function(depth)
    if depth > 200 then error("value nested too deeply", 0) end
    skip()
    local c = text:sub(pos, pos)
    if c == "{" then
      pos = pos + 1; skip()
      local obj, count = {}, 0
      if text:sub(pos, pos) == "}" then pos = pos + 1; return obj end
      while true do
        skip()
        local key = str(); skip()
        if text:sub(pos, pos) ~= ":" then error("expected :", 0) end
        pos = pos + 1
        obj[key] = value(depth + 1); count = count + 1
        skip()
        local d = text:sub(pos, pos); pos = pos + 1
        if d == "}" then break end
        if d ~= "," then error("expected , or }", 0) end
      end
      if count ~= 1 then error("a wire object has exactly one tag", 0) end
      local tag, body = next(obj)
      if tag == "$t" or tag == "$s" or tag == "$fs" then return body end
      if tag == "$d" then
        local t = {}
        for _, pair in ipairs(body) do t[pair[1]] = pair[2] end
        return t
      end
      if tag == "$b" then return (body:gsub("..", function(h) return string.char(tonumber(h, 16)) end)) end
      if tag == "$f" then return ({ nan = 0 / 0, inf = math.huge, ["-inf"] = -math.huge })[body] end
      if tag == "$u" then return nil end
      error("unknown wire tag " .. tostring(tag), 0)
    elseif c == "[" then
      pos = pos + 1; skip()
      local arr, n = {}, 0
      if text:sub(pos, pos) == "]" then pos = pos + 1; return arr end
      while true do
        n = n + 1
        arr[n] = value(depth + 1)
        skip()
        local d = text:sub(pos, pos); pos = pos + 1
        if d == "]" then break end
        if d ~= "," then error("expected , or ]", 0) end
      end
      return arr
    elseif c == '"' then
      return str()
    elseif text:sub(pos, pos + 3) == "true" then pos = pos + 4; return true
    elseif text:sub(pos, pos + 4) == "false" then pos = pos + 5; return false
    elseif text:sub(pos, pos + 3) == "null" then pos = pos + 4; return nil
    end
    local num = text:match("^-?%d+%.?%d*[eE]?[-+]?%d*", pos)
    if not num or num == "" then error("bad JSON at " .. pos, 0) end
    pos = pos + #num
    return math.tointeger(tonumber(num)) or tonumber(num)
  end
  local v = value(0)
  return v
end

-- A message is a JSON array of `n` items; an item may be nil (a function that returns nothing).
local function send(n, ...)
  local items = table.pack(...)
  local ok, data = pcall(function()
    local parts = {}
    for i = 1, n do parts[i] = encode(items[i], 1) end
    return "[" .. table.concat(parts, ",") .. "]"
  end)
  if not ok then data = '["error",' .. encode_string(tostring(data):sub(1, 500)) .. "]" end
  cout:write(string.pack(">I4", #data) .. data)
end

local function read(n)
  local buf = cin:read(n)
  if buf == nil or #buf < n then return nil end
  return buf
end

local loaded, err = pcall(dofile, "/work/main.lua")
if not loaded then
  send(3, "loadfail", "error", tostring(err):sub(1, 500))
  error(err, 0)
end
send(1, "ready")
while true do
  local head = read(4)
  if head == nil then break end
  local body = read((string.unpack(">I4", head)))
  if body == nil then break end
  local ok, msg = pcall(decode, body)
  if not ok or type(msg) ~= "table" then
    send(2, "error", "bad request")
  else
    local op, name, args = msg[1], msg[2], msg[3] or {}
    local fn = type(name) == "string" and not builtin[name] and rawget(_G, name) or nil
    if op ~= "call" or type(fn) ~= "function" then
      send(3, "raise", "error", "no function " .. tostring(name):sub(1, 80) .. " is defined")
    else
      local n = 0
      for i in pairs(args) do if i > n then n = i end end
      local results = table.pack(pcall(fn, table.unpack(args, 1, n)))
      if results[1] then
        send(2, "ok", results[2])
      else
        send(3, "raise", "error", tostring(results[2]):sub(1, 500))
      end
    end
  end
end
