# Call server for Ruby (ruby -e THIS IN_FD OUT_FD): loads /work/main.rb, then answers the
# supervisor's calls of its top-level methods by value until the supervisor closes the pipe.
# Values cross as the tagged JSON of workers/sandbox/harness/wire.py. This runs in the
# candidate's process and nothing it sends is trusted: the supervisor compares the results.
require "json"
require "set"

crucible_in = IO.new(Integer(ARGV.shift), "rb")
crucible_out = IO.new(Integer(ARGV.shift), "wb")
crucible_out.sync = true

crucible_encode = lambda do |v, depth = 0|
  raise TypeError, "value nested too deeply to send" if depth > 200
  case v
  when nil, true, false then v
  when Integer then v
  when Float
    if v.nan? then { "$f" => "nan" }
    elsif v.infinite? then { "$f" => v > 0 ? "inf" : "-inf" }
    else v
    end
  when Symbol then v.to_s
  when String
    if v.encoding == Encoding::BINARY && !v.dup.force_encoding("UTF-8").valid_encoding?
      { "$b" => v.unpack1("H*") }
    else
      s = v.encoding == Encoding::UTF_8 ? v : v.dup.force_encoding("UTF-8")
      raise TypeError, "a string that is not UTF-8 cannot be passed" unless s.valid_encoding?
      s
    end
  when Array then v.map { |x| crucible_encode.call(x, depth + 1) }
  when Set then { "$s" => v.map { |x| crucible_encode.call(x, depth + 1) } }
  when Hash then { "$d" => v.map { |k, x| [crucible_encode.call(k, depth + 1), crucible_encode.call(x, depth + 1)] } }
  else raise TypeError, "a #{v.class} cannot be passed by value"
  end
end

crucible_decode = lambda do |v, depth = 0|
  raise TypeError, "value nested too deeply" if depth > 200
  case v
  when Array then v.map { |x| crucible_decode.call(x, depth + 1) }
  when Hash
    raise TypeError, "a wire object has exactly one tag" unless v.size == 1
    tag, body = v.first
    case tag
    when "$t" then body.map { |x| crucible_decode.call(x, depth + 1) }
    when "$s", "$fs" then Set.new(body.map { |x| crucible_decode.call(x, depth + 1) })
    when "$d" then body.to_h { |k, x| [crucible_decode.call(k, depth + 1), crucible_decode.call(x, depth + 1)] }
    when "$b" then [body].pack("H*")
    when "$f" then { "nan" => Float::NAN, "inf" => Float::INFINITY, "-inf" => -Float::INFINITY }.fetch(body)
    when "$u" then nil
    else raise TypeError, "unknown wire tag #{tag}"
    end
  else v
  end
end

crucible_send = lambda do |msg|
  data = begin
    JSON.generate(crucible_encode.call(msg))
  rescue StandardError => e
    JSON.generate(["error", e.message[0, 500]])
  end
  crucible_out.write([data.bytesize].pack("N") + data)
end

crucible_read = lambda do |n|
  buf = crucible_in.read(n)
  return nil if buf.nil? || buf.bytesize < n
  buf
end

Dir.chdir("/work")
begin
  load "/work/main.rb"
rescue Exception => e # rubocop:disable Lint/RescueException - any failure to load is reported
  crucible_send.call(["loadfail", e.class.name, e.message[0, 500]])
  raise
end
crucible_send.call(["ready"])
main = TOPLEVEL_BINDING.receiver
loop do
  head = crucible_read.call(4)
  break if head.nil?
  body = crucible_read.call(head.unpack1("N"))
  break if body.nil?
  begin
    op, name, args, = crucible_decode.call(JSON.parse(body))
  rescue StandardError
    crucible_send.call(["error", "bad request"])
    next
  end
  # only methods the program defined at top level (Object's own), never Kernel's
  unless op == "call" && name.is_a?(String) && name.match?(/\A[A-Za-z_]\w*[?!]?\z/) &&
         (Object.private_instance_methods(false) + Object.public_instance_methods(false))
           .include?(name.to_sym)
    crucible_send.call(["raise", "NameError", "no function #{name.to_s[0, 80]} is defined"])
    next
  end
  begin
    result = main.__send__(name, *args)
  rescue StandardError => e
    crucible_send.call(["raise", e.class.name, e.message[0, 500]])
    next
  end
  crucible_send.call(["ok", result])
end
