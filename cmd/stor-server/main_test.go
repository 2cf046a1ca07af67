package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stor-io/stor/internal/logging"
)

// lockedBuffer collects the server's log lines while the test reads them.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// jsonLines decodes every line of out as one JSON object, failing the
// test on a line that is not.
func jsonLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for _, l := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		if l == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("--log-format=json wrote a line that is not JSON: %q: %v", l, err)
		}
		lines = append(lines, m)
	}
	return lines
}

// stor-server --log-format=json logs JSON lines only; with --metrics-listen
// it serves /healthz, /readyz (200 once the one-server cluster it
// bootstraps has elected it) and /metrics on the address it logs.
func TestRunJSONLogsAndReadyz(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a server; skipped with -short")
	}
	out := &lockedBuffer{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{
			"--id=solo", "--data-dir=" + filepath.Join(t.TempDir(), "data"), "--insecure", "--capacity=1GiB",
			"--listen=127.0.0.1:0", "--raft-listen=127.0.0.1:0", "--data-listen=127.0.0.1:0",
			"--metrics-listen=127.0.0.1:0", "--log-format=json",
		}, out)
	}()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("the server did not stop within 30s")
		}
		jsonLines(t, out.String()) // the shutdown's lines too
	}()

	// The metrics address, from the JSON log line that names it.
	addr := ""
	deadline := time.Now().Add(20 * time.Second)
	for addr == "" {
		for _, l := range jsonLines(t, out.String()) {
			if l["msg"] == "serving metrics and health" {
				addr, _ = l["address"].(string)
			}
		}
		select {
		case err := <-done:
			t.Fatalf("run ended before serving metrics: %v\n%s", err, out)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %q log line within 20s:\n%s", "serving metrics and health", out)
		}
	}
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz: %d %s", code, body)
	}
	for {
		code, body := get("/readyz")
		if code == http.StatusOK {
			break
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "leader") {
			t.Fatalf("/readyz before ready: %d %q, want 503 naming the missing leader", code, body)
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz not ready within 20s: %d %s", code, body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, body := get("/metrics"); !strings.Contains(body, `stor_raft_state{state="Leader"} 1`) {
		t.Fatalf("/metrics of a one-server cluster does not show it leading:\n%s", body)
	}
	if lines := jsonLines(t, out.String()); len(lines) < 2 {
		t.Fatalf("only %d log lines", len(lines))
	}
}

// A --log-format other than text or json is refused before anything
// starts, naming the value and the choices.
func TestRunRefusesLogFormat(t *testing.T) {
	var out bytes.Buffer
	err := run(context.Background(), []string{"--id=solo", "--data-dir=" + t.TempDir(), "--log-format=xml"}, &out)
	if !errors.Is(err, logging.ErrFormat) || !strings.Contains(err.Error(), `"xml"`) || !strings.Contains(err.Error(), `"json"`) {
		t.Fatalf("--log-format=xml: %v, want an error naming xml and the formats", err)
	}
	if out.Len() != 0 {
		t.Fatalf("--log-format=xml logged %q", out.String())
	}
}
