-- wrk script of bench.loadgen: the request from environment variables, and a JSON summary with
-- the count per status code (wrk itself only counts "non-2xx or 3xx").
--   WRK_METHOD, WRK_BODY_FILE (optional), WRK_HEADERS ("Name: value" lines)
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  statuses = {}
  wrk.method = os.getenv("WRK_METHOD") or "GET"
  local body_file = os.getenv("WRK_BODY_FILE")
  if body_file and body_file ~= "" then
    local f = assert(io.open(body_file, "rb"))
    wrk.body = f:read("*a")
    f:close()
    wrk.headers["Content-Type"] = "application/json"
  end
  for line in (os.getenv("WRK_HEADERS") or ""):gmatch("[^\n]+") do
    local name, value = line:match("^([^:]+):%s*(.*)$")
    if name then wrk.headers[name] = value end
  end
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local counts = {}
  for _, t in ipairs(threads) do
    for code, n in pairs(t:get("statuses")) do
      counts[code] = (counts[code] or 0) + n
    end
  end
  local parts = {}
  for code, n in pairs(counts) do
    table.insert(parts, string.format('"%d": %d', code, n))
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "seconds": %.6f, "p50_ms": %.3f, "p90_ms": %.3f, "p99_ms": %.3f, '
      .. '"max_ms": %.3f, "statuses": {%s}, "socket_errors": %d}\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50) / 1e3, latency:percentile(90) / 1e3,
    latency:percentile(99) / 1e3, latency.max / 1e3, table.concat(parts, ", "),
    e.connect + e.read + e.write + e.timeout))
end
