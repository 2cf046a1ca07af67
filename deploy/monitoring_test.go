package deploy

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/yaml"

	"github.com/stor-io/stor/internal/metrics"
)

// publishedNames are the metric names stor's collectors describe.
func publishedNames(t *testing.T) map[string]bool {
	t.Helper()
	cs := []prometheus.Collector{
		metrics.NewRaft(nil), metrics.NewCluster(nil), metrics.NewDisk(""), metrics.NewDataPort(nil),
		metrics.NewRPCs("api"), metrics.NewRPCs("csi"), metrics.NewVolumes(),
	}
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	names := map[string]bool{}
	ch := make(chan *prometheus.Desc, 64)
	for _, c := range cs {
		go func() { c.Describe(ch); ch <- nil }()
		for d := <-ch; d != nil; d = <-ch {
			m := fq.FindStringSubmatch(d.String())
			if m == nil {
				t.Fatalf("cannot read the name of %s", d)
			}
			names[m[1]] = true
		}
	}
	return names
}

var storName = regexp.MustCompile(`\bstor_[a-z_]+\b`)

// checkExpr fails the test if expr names a stor_ series no collector
// publishes (a histogram's _bucket, _sum and _count count as its name) or
// has unbalanced brackets.
func checkExpr(t *testing.T, where, expr string, names map[string]bool) {
	t.Helper()
	found := false
	for _, n := range storName.FindAllString(expr, -1) {
		found = true
		base := n
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(n, suf); ok && names[b] {
				base = b
			}
		}
		if !names[base] {
			t.Errorf("%s: %q names %s, which stor does not publish", where, expr, n)
		}
	}
	if !found {
		t.Errorf("%s: %q names no stor series", where, expr)
	}
	for _, p := range []string{"()", "{}", "[]"} {
		if strings.Count(expr, p[:1]) != strings.Count(expr, p[1:]) {
			t.Errorf("%s: %q has unbalanced %s", where, expr, p)
		}
	}
}

// The alerts and the dashboard in deploy/monitoring use only series stor
// publishes, and the alerts the operator needs are there.
func TestMonitoringUsesPublishedSeries(t *testing.T) {
	names := publishedNames(t)
	if !names["stor_raft_state"] || !names["stor_volume_op_duration_seconds"] {
		t.Fatalf("the collectors describe %d names, not the expected ones: %v", len(names), names)
	}

	b, err := os.ReadFile("monitoring/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rule struct {
		APIVersion string         `json:"apiVersion"`
		Kind       string         `json:"kind"`
		Metadata   map[string]any `json:"metadata"`
		Spec       struct {
			Groups []struct {
				Name  string `json:"name"`
				Rules []struct {
					Alert       string            `json:"alert"`
					Expr        string            `json:"expr"`
					For         string            `json:"for"`
					Labels      map[string]string `json:"labels"`
					Annotations map[string]string `json:"annotations"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"spec"`
	}
	if err := yaml.UnmarshalStrict(b, &rule); err != nil {
		t.Fatalf("prometheusrule.yaml: %v", err)
	}
	if rule.APIVersion != "monitoring.coreos.com/v1" || rule.Kind != "PrometheusRule" {
		t.Fatalf("prometheusrule.yaml is %s %s", rule.APIVersion, rule.Kind)
	}
	alerts := map[string]string{}
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			alerts[r.Alert] = r.Expr
			checkExpr(t, "alert "+r.Alert, r.Expr, names)
			if _, err := time.ParseDuration(r.For); err != nil {
				t.Errorf("alert %s: for %q: %v", r.Alert, r.For, err)
			}
			if r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("alert %s has no severity or summary", r.Alert)
			}
		}
	}
	for alert, series := range map[string]string{
		"StorNoRaftLeader": "stor_raft_state", "StorReplicaFaulty": "stor_replicas",
		"StorServerDown": "stor_server_up", "StorCapacityHigh": "stor_server_allocated_bytes",
	} {
		if !strings.Contains(alerts[alert], series) {
			t.Errorf("alert %s missing or not on %s: %q", alert, series, alerts[alert])
		}
	}

	b, err = os.ReadFile("monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Title  string `json:"title"`
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("grafana-dashboard.json: %v", err)
	}
	exprs := 0
	for _, p := range dash.Panels {
		if p.Type != "row" && len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			exprs++
			checkExpr(t, "panel "+p.Title, tg.Expr, names)
		}
	}
	if exprs < 10 {
		t.Errorf("the dashboard has %d queries", exprs)
	}
}
