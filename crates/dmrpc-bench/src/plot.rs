//! PNG plots of benchmark results (plotters, bitmap backend), drawn from
//! the same rows the CSV holds, by a declarative [`Chart`]: which column
//! is x, which columns are y, which column splits the rows into series.
//!
//! Numeric x gives lines with points; a text x (a transport's name, say)
//! gives grouped bars. Log axes are drawn by plotting log10 of the values
//! on a linear axis and labelling ticks with the values themselves. Text
//! is rendered with DejaVu Sans from the system (`scripts/deps.sh`
//! installs `fonts-dejavu-core`).

use super::serde_like::Obj;
use anyhow::{anyhow, bail, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::Path;
use std::sync::OnceLock;

/// What to draw from a benchmark's rows.
#[derive(Debug, Clone, Copy)]
pub struct Chart<'a> {
    pub title: &'a str,
    /// The x column: numeric (lines) or text (grouped bars).
    pub x: &'a str,
    /// One series per y column ...
    pub ys: &'a [&'a str],
    /// ... and per distinct value of this column, if given.
    pub by: Option<&'a str>,
    pub y_label: &'a str,
    pub log_x: bool,
    pub log_y: bool,
}

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers DejaVu Sans as plotters' "sans-serif", once.
fn font() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = FONT_PATHS
            .iter()
            .find_map(|p| std::fs::read(p).ok())
            .ok_or_else(|| {
                "no DejaVu Sans font for the plots: install fonts-dejavu-core (scripts/deps.sh does)"
                    .to_string()
            })?;
        plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            Box::leak(bytes.into_boxed_slice()),
        )
        .map_err(|_| "the DejaVu Sans font file is not a valid font".to_string())
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

fn num(o: &Obj, k: &str) -> Option<f64> {
    o.text(k)?.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// A compact tick label: 1.5k, 2M, 0.25.
fn tick(v: f64) -> String {
    let a = v.abs();
    let (x, unit) = match a {
        a if a >= 1e9 => (v / 1e9, "G"),
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e3 => (v / 1e3, "k"),
        _ => (v, ""),
    };
    let s = if x.fract().abs() < 1e-9 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    };
    // 1.50 -> 1.5, 2.0 -> 2 (only after a decimal point).
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    let s = if s == "-0" { "0" } else { s };
    format!("{s}{unit}")
}

struct Axis {
    log: bool,
}

impl Axis {
    fn to(&self, v: f64) -> Option<f64> {
        match self.log {
            true if v > 0.0 => Some(v.log10()),
            true => None,
            false => Some(v),
        }
    }
    /// The label of a tick at `v` (axis space) on an axis spanning
    /// `span`: on a log axis spanning a decade or more, powers of ten only.
    fn label(&self, v: f64, span: f64) -> String {
        if self.log && span >= 1.0 && (v - v.round()).abs() > 1e-6 {
            return String::new();
        }
        tick(self.from(v))
    }

    fn from(&self, v: f64) -> f64 {
        if self.log {
            10f64.powf(v)
        } else {
            v
        }
    }
}

/// The series of a chart: (name, points in axis space).
type Series = Vec<(String, Vec<(f64, f64)>)>;

/// Draws `chart` from `rows` as a PNG at `path`.
pub fn draw(path: &Path, chart: &Chart, rows: &[Obj]) -> Result<()> {
    font()?;
    let categorical = rows
        .iter()
        .any(|r| r.text(chart.x).is_some() && num(r, chart.x).is_none());
    let xa = Axis {
        log: chart.log_x && !categorical,
    };
    let ya = Axis { log: chart.log_y };
    // Categories in order of first appearance (bars), else numeric x.
    let mut cats: Vec<String> = Vec::new();
    let mut series: Series = Vec::new();
    for r in rows {
        let x = if categorical {
            let Some(c) = r.text(chart.x) else { continue };
            let i = match cats.iter().position(|k| k == c) {
                Some(i) => i,
                None => {
                    cats.push(c.to_owned());
                    cats.len() - 1
                }
            };
            i as f64
        } else {
            match num(r, chart.x).and_then(|v| xa.to(v)) {
                Some(x) => x,
                None => continue,
            }
        };
        for y in chart.ys {
            let Some(v) = num(r, y).and_then(|v| ya.to(v)) else {
                continue;
            };
            let name = match (chart.by.and_then(|b| r.text(b)), chart.ys.len()) {
                (Some(b), 1) => b.to_owned(),
                (Some(b), _) => format!("{b} {y}"),
                (None, _) => (*y).to_owned(),
            };
            match series.iter_mut().find(|(n, _)| *n == name) {
                Some((_, pts)) => pts.push((x, v)),
                None => series.push((name, vec![(x, v)])),
            }
        }
    }
    if series.is_empty() {
        bail!("nothing to plot for {}", chart.title);
    }
    let all = || series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1) = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (mut y0, mut y1) = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    if categorical {
        (x0, x1) = (-0.5, cats.len() as f64 - 0.5);
    }
    if !ya.log {
        y0 = y0.min(0.0);
    }
    let pad = |a: f64, b: f64| {
        let d = if b > a {
            (b - a) * 0.06
        } else {
            a.abs().max(1.0) * 0.1
        };
        (a - d, b + d)
    };
    if !categorical {
        (x0, x1) = pad(x0, x1);
    }
    (y0, y1) = pad(y0, y1);
    // Headroom for the legend (upper left).
    y1 += (y1 - y0) * 0.25;
    if !ya.log && y0 < 0.0 && all().all(|p| p.1 >= 0.0) {
        y0 = 0.0;
    }

    // Wide enough for one category's name per bar group.
    let longest = cats.iter().map(|c| c.len()).max().unwrap_or(0) as u32;
    let width = (cats.len() as u32 * (longest * 7 + 16) + 120).max(960);
    let root = BitMapBackend::new(path, (width, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut c = ChartBuilder::on(&root)
        .caption(chart.title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    let xfmt = |v: &f64| {
        if categorical {
            let i = v.round();
            match cats.get(i as usize) {
                Some(c) if (v - i).abs() < 0.01 && i >= 0.0 => c.clone(),
                _ => String::new(),
            }
        } else {
            xa.label(*v, x1 - x0)
        }
    };
    let yfmt = |v: &f64| ya.label(*v, y1 - y0);
    let mut mesh = c.configure_mesh();
    mesh.x_desc(chart.x)
        .y_desc(chart.y_label)
        .x_label_formatter(&xfmt)
        .y_label_formatter(&yfmt)
        .label_style(("sans-serif", 14));
    if categorical {
        mesh.x_labels(cats.len() * 4 + 1)
            .disable_x_mesh()
            .x_label_style(("sans-serif", 12));
    }
    mesh.draw()?;
    let n = series.len() as f64;
    for (k, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(k).to_rgba();
        if categorical {
            let w = 0.8 / n;
            c.draw_series(pts.iter().map(|&(x, y)| {
                let left = x - 0.4 + k as f64 * w;
                Rectangle::new([(left, y0), (left + w * 0.9, y)], color.filled())
            }))?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
        } else {
            let mut line = pts.clone();
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            c.draw_series(LineSeries::new(line, color.stroke_width(2)))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_compact() {
        assert_eq!(tick(1500.0), "1.5k");
        assert_eq!(tick(2_000_000.0), "2M");
        assert_eq!(tick(0.25), "0.25");
        assert_eq!(tick(64.0), "64");
        assert_eq!(tick(0.0), "0");
    }

    #[test]
    fn draws_lines_and_bars() {
        if font().is_err() {
            eprintln!("no DejaVu font here: plots are not drawn (scripts/deps.sh installs it)");
            return;
        }
        let dir = std::env::temp_dir().join(format!("dmrpc-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut rows = Vec::new();
        for (sys, f) in [("a", 1.0), ("b", 3.0)] {
            for x in [1.0, 10.0, 100.0] {
                let mut o = Obj::default();
                o.str("system", sys);
                o.str("name", &format!("t{x}"));
                o.num("size", x);
                o.num("v", x * f);
                rows.push(o);
            }
        }
        let lines = Chart {
            title: "lines",
            x: "size",
            ys: &["v"],
            by: Some("system"),
            y_label: "v",
            log_x: true,
            log_y: true,
        };
        draw(&dir.join("lines.png"), &lines, &rows).unwrap();
        let bars = Chart {
            x: "name",
            log_y: false,
            ..lines
        };
        draw(&dir.join("bars.png"), &bars, &rows).unwrap();
        for f in ["lines.png", "bars.png"] {
            let b = std::fs::read(dir.join(f)).unwrap();
            assert_eq!(&b[1..4], b"PNG", "{f} is a PNG");
            assert!(b.len() > 5000, "{f} has content");
        }
        assert!(draw(
            &dir.join("none.png"),
            &Chart {
                ys: &["absent"],
                ..lines
            },
            &rows
        )
        .is_err());
        if std::env::var_os("KEEP_PLOTS").is_none() {
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
