// Call server for PHP (php -r THIS IN_FD OUT_FD; no opening tag: -r takes bare code). Loads
// /work/main.php, then answers the supervisor's calls of its user-defined functions by value
// until the supervisor closes the pipe. Values cross as the tagged JSON of
// workers/sandbox/harness/wire.py. This runs in the candidate's process and nothing it sends is
// trusted: the supervisor compares the results.
// php://fd/N dup()s N, and refuses an N at or above RLIMIT_NOFILE: the engine raises this
// server's limit above the pipes' numbers (inherited fds keep the supervisor's numbers).
$crucible_in = fopen("php://fd/" . intval($argv[1]), "rb");
$crucible_out = fopen("php://fd/" . intval($argv[2]), "wb");
array_splice($argv, 1, 2);
$argc = count($argv);

function crucible_encode($v, $depth = 0) {
    if ($depth > 200) throw new TypeError("value nested too deeply to send");
    if (is_null($v) || is_bool($v) || is_int($v)) return $v;
    if (is_float($v)) {
        if (is_nan($v)) return ["\$f" => "nan"];
        if (is_infinite($v)) return ["\$f" => $v > 0 ? "inf" : "-inf"];
        return $v;
    }
    if (is_string($v)) return preg_match("//u", $v) === 1 ? $v : ["\$b" => bin2hex($v)];
    if (is_array($v)) {
        if (array_is_list($v)) return array_map(fn($x) => crucible_encode($x, $depth + 1), $v);
        $pairs = [];
        foreach ($v as $k => $x) $pairs[] = [crucible_encode($k, $depth + 1), crucible_encode($x, $depth + 1)];
        return ["\$d" => $pairs];
    }
    throw new TypeError("a " . get_debug_type($v) . " cannot be passed by value");
}

function crucible_decode($v, $depth = 0) {
    if ($depth > 200) throw new TypeError("value nested too deeply");
    if (!is_array($v)) return $v;
    if (array_is_list($v)) return array_map(fn($x) => crucible_decode($x, $depth + 1), $v);
    if (count($v) !== 1) throw new TypeError("a wire object has exactly one tag");
    $tag = array_key_first($v);
    $body = $v[$tag];
    switch ($tag) {
        case "\$t": case "\$s": case "\$fs":
            return array_map(fn($x) => crucible_decode($x, $depth + 1), $body);
        case "\$d":
            $out = [];
            foreach ($body as $pair) $out[crucible_decode($pair[0], $depth + 1)] = crucible_decode($pair[1], $depth + 1);
            return $out;
        case "\$b": return hex2bin($body);
        case "\$f": return $body === "nan" ? NAN : ($body === "inf" ? INF : -INF);
        case "\$u": return null;
    }
    throw new TypeError("unknown wire tag $tag");
}

function crucible_send($out, $msg) {
    try {
        $data = json_encode(crucible_encode($msg), JSON_PRESERVE_ZERO_FRACTION | JSON_THROW_ON_ERROR);
    } catch (Throwable $e) {
        $data = json_encode(["error", substr($e->getMessage(), 0, 500)]);
    }
    fwrite($out, pack("N", strlen($data)) . $data);
    fflush($out);
}

function crucible_read($in, $n) {
    $buf = "";
    while (strlen($buf) < $n) {
        $chunk = fread($in, $n - strlen($buf));
        if ($chunk === false || $chunk === "") return null;
        $buf .= $chunk;
    }
    return $buf;
}

chdir("/work");
$crucible_builtin = get_defined_functions()["user"];
try {
    require "/work/main.php";
} catch (Throwable $e) {
    crucible_send($crucible_out, ["loadfail", get_class($e), substr($e->getMessage(), 0, 500)]);
    throw $e;
}
crucible_send($crucible_out, ["ready"]);
while (true) {
    $head = crucible_read($crucible_in, 4);
    if ($head === null) break;
    $body = crucible_read($crucible_in, unpack("N", $head)[1]);
    if ($body === null) break;
    try {
        [$op, $name, $args] = crucible_decode(json_decode($body, true, 512, JSON_THROW_ON_ERROR));
    } catch (Throwable $e) {
        crucible_send($crucible_out, ["error", "bad request"]);
        continue;
    }
    // only functions the program defined, never PHP's own or this server's
    $mine = array_diff(get_defined_functions()["user"], $crucible_builtin);
    if ($op !== "call" || !is_string($name) || !in_array(strtolower($name), $mine, true)) {
        crucible_send($crucible_out, ["raise", "Error", "no function " . substr((string)$name, 0, 80) . " is defined"]);
        continue;
    }
    try {
        $result = call_user_func_array($name, $args);
    } catch (Throwable $e) {
        crucible_send($crucible_out, ["raise", get_class($e), substr($e->getMessage(), 0, 500)]);
        continue;
    }
    crucible_send($crucible_out, ["ok", $result]);
}
