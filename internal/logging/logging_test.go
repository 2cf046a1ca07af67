package logging_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/stor-io/stor/internal/logging"
)

func TestNew(t *testing.T) {
	var buf bytes.Buffer
	log, err := logging.New(&buf, "json", "info")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("hello", "volume", "db")
	log.Debug("hidden at info")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 1 {
		t.Fatalf("json at info wrote %d lines, want 1:\n%s", len(lines), buf.String())
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &m); err != nil {
		t.Fatalf("json line %q: %v", lines[0], err)
	}
	if m["msg"] != "hello" || m["volume"] != "db" || m["level"] != "INFO" {
		t.Fatalf("json line %v: want msg hello, volume db, level INFO", m)
	}

	buf.Reset()
	log, err = logging.New(&buf, "text", "debug")
	if err != nil {
		t.Fatal(err)
	}
	log.Debug("shown", "k", "v")
	if got := buf.String(); !strings.Contains(got, "msg=shown k=v") || json.Valid(buf.Bytes()) {
		t.Fatalf("text line %q: want key=value", got)
	}

	for _, tc := range []struct{ format, level string }{{"xml", "info"}, {"JSON", "info"}, {"", "info"}, {"json", "loud"}} {
		if _, err := logging.New(&buf, tc.format, tc.level); err == nil {
			t.Errorf("New(%q, %q) = nil error", tc.format, tc.level)
		} else if tc.level == "info" && !errors.Is(err, logging.ErrFormat) {
			t.Errorf("New(%q): %v, want ErrFormat", tc.format, err)
		}
	}
}
